"""The ``ninfer`` command: ``generate``, ``ppl``, ``convert`` and ``serve`` subcommands."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ninfer.cli_structured import add_structured_options, constraint_from_args

GENERATE_EXAMPLES = """examples:
  ninfer generate --prompt "Why is the sky blue?"            # bundled tiny default model
  ninfer generate Qwen/Qwen3.6-27B --prompt "Hi" --no-thinking --max-new 64
  ninfer generate ./my-model --messages chat.json --greedy
"""


class CliError(Exception):
    """A user error: printed as ``ninfer: error: ...`` with exit status 2, no traceback."""


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be >= 1, got {value}")
        return value
    return parse


def _draft_tokens(text: str) -> int:
    from ninfer.runtime.speculative import MAX_DRAFT_TOKENS

    k = _positive("--draft-tokens")(text)
    if k > MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"--draft-tokens must be 1-{MAX_DRAFT_TOKENS}, got {k}")
    return k


def add_spec_options(p: argparse.ArgumentParser) -> None:
    """``--spec`` and ``--draft-tokens``, shared by ``generate`` and ``serve``."""
    p.add_argument("--spec", choices=["mtp"], help="speculative decoding with the checkpoint's MTP head")
    p.add_argument("--draft-tokens", type=_draft_tokens, default=3, metavar="K",
                   help="tokens drafted per speculative round, 1-7 (default 3; needs --spec)")


def _kv_capacity(text: str) -> int | str:
    if text == "auto":
        return text
    return _positive("--kv-capacity")(text)


def _add_model_options(p: argparse.ArgumentParser, engine: bool = False) -> None:
    p.add_argument("--device", help="torch device, e.g. cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="compute dtype (default: bf16 on GPU, fp32 on CPU)")
    if not engine:
        return
    p.add_argument("--max-context", type=_positive("--max-context"), default=4096, metavar="N",
                   help="most tokens per sequence, prompt + output (default 4096)")
    p.add_argument("--kv-capacity", type=_kv_capacity, metavar="N|auto",
                   help="KV pool size in tokens, or 'auto' to fill free GPU memory (default: --max-context)")
    p.add_argument("--kv-dtype", choices=["auto", "bf16", "fp8", "int8"], default="auto",
                   help="KV cache storage (default: the model dtype)")
    p.add_argument("--prefill-chunk", type=_positive("--prefill-chunk"), default=8192, metavar="N",
                   help="most prompt tokens per prefill step (default 8192)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    add_spec_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="Fast inference for the Qwen3.5 model family.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate a reply to a prompt or a chat",
                         description="Generate a reply. The answer goes to stdout; reasoning, timings and "
                                     "tok/s go to stderr.", epilog=GENERATE_EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("model", nargs="?", help="checkpoint directory or Hugging Face id (default: bundled tiny model)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="user message text (rendered with the chat template)")
    source.add_argument("--messages", type=Path, metavar="FILE",
                        help="JSON file: a list of chat messages, or {\"messages\": [...], \"tools\": [...]}")
    gen.add_argument("--raw", action="store_true", help="send --prompt as raw text, without the chat template")
    gen.add_argument("--max-new", type=_positive("--max-new"), default=256, metavar="N",
                     help="maximum number of generated tokens (default 256)")
    gen.add_argument("--greedy", action="store_true", help="always take the most likely token")
    gen.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default: generation_config)")
    gen.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass (default: generation_config)")
    gen.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens, 0 = all")
    gen.add_argument("--seed", type=int, metavar="N", help="sampling seed (default: random)")
    gen.add_argument("--no-thinking", action="store_true", help="turn the model's reasoning phase off")
    gen.add_argument("--stop", action="append", metavar="TEXT", help="stop at this text (repeatable)")
    gen.add_argument("--vision", action="store_true",
                     help="load the vision tower; --messages may hold image_url / video_url parts")
    add_structured_options(gen)
    _add_model_options(gen, engine=True)

    ppl = sub.add_parser("ppl", help="perplexity of a text file",
                         description="Score a UTF-8 text file with sliding windows and print tokens, mean NLL "
                                     "and perplexity.",
                         epilog="example:\n  ninfer ppl ./my-model --text wiki.txt --context 4096 --stride 2048 "
                                "--output report.json", formatter_class=argparse.RawDescriptionHelpFormatter)
    ppl.add_argument("model", help="checkpoint directory or Hugging Face id")
    ppl.add_argument("--text", type=Path, required=True, metavar="FILE", help="UTF-8 text to score")
    ppl.add_argument("--context", type=_positive("--context"), default=4096, metavar="N",
                     help="window length in tokens (default 4096)")
    ppl.add_argument("--stride", type=_positive("--stride"), default=2048, metavar="N",
                     help="window advance in tokens (default 2048)")
    ppl.add_argument("--output", type=Path, metavar="FILE", help="write a JSON report with per-window numbers")
    _add_model_options(ppl)

    conv = sub.add_parser("convert", help="quantize a bf16 checkpoint with a recipe",
                          description="Quantize a Hugging Face bf16 checkpoint tensor by tensor into a ninfer "
                                      "checkpoint directory (safetensors + ninfer.json) that ninfer.load reads "
                                      "without repacking.",
                          epilog="examples:\n  ninfer convert --list-recipes\n"
                                 "  ninfer convert ./Qwen3.6-27B --recipe qwen3_5_27b_int4 --out ./Qwen3.6-27B-int4",
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    conv.add_argument("src", nargs="?", help="bf16 checkpoint directory or Hugging Face id")
    conv.add_argument("--recipe", metavar="NAME_OR_FILE", help="a shipped recipe name or a recipe JSON file")
    conv.add_argument("--out", type=Path, metavar="DIR", help="output directory (must not exist or be empty)")
    conv.add_argument("--device", help="where to quantize (default: cuda if available)")
    conv.add_argument("--list-recipes", action="store_true", help="list the shipped recipes and exit")

    from ninfer.api.cli import add_serve_parser

    add_serve_parser(sub)
    return parser


def _read_messages(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(f"--messages: file {path} not found") from None
    except json.JSONDecodeError as err:
        raise CliError(f"--messages: {path} is not valid JSON ({err})") from None
    messages, tools = (data.get("messages"), data.get("tools")) if isinstance(data, dict) else (data, None)
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise CliError("--messages: expected a JSON list of {\"role\": ..., \"content\": ...} objects "
                       "or an object with a \"messages\" list")
    return messages, tools


def _load(args: argparse.Namespace, **engine):
    import ninfer

    return ninfer.load(args.model, device=args.device, dtype=args.dtype, **engine)


def run_generate(args: argparse.Namespace) -> None:
    if args.raw and args.messages:
        raise CliError("--raw applies to --prompt only")
    for flag, value, ok in (("--temperature", args.temperature, lambda v: v >= 0),
                            ("--top-p", args.top_p, lambda v: 0 < v <= 1), ("--top-k", args.top_k, lambda v: v >= 0)):
        if value is not None and not ok(value):
            raise CliError(f"{flag} is out of range: {value}")
    constraint = constraint_from_args(args)  # before loading: a bad flag fails fast
    messages, tools = _read_messages(args.messages) if args.messages else (
        [{"role": "user", "content": args.prompt}], None)
    if args.messages:
        from ninfer.vision import rebase_local_paths

        messages = rebase_local_paths(messages, args.messages.parent)  # media paths relative to the file
    llm = _load(args, max_concurrency=1, max_context=args.max_context, kv_capacity=args.kv_capacity,
                kv_dtype=args.kv_dtype, prefill_chunk=args.prefill_chunk, cuda_graphs=not args.no_cuda_graphs,
                vision=args.vision, spec=args.spec, draft_tokens=args.draft_tokens)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                    greedy=args.greedy, structured=constraint)
    if args.raw:
        completion = llm.generate(args.prompt, max_new_tokens=args.max_new, stop=args.stop, **sampling)
    else:
        completion = llm.chat(messages, tools=tools, enable_thinking=not args.no_thinking,
                              max_new_tokens=args.max_new, stop=args.stop, **sampling)
    if completion.reasoning:
        print(f"[reasoning]\n{completion.reasoning}\n[/reasoning]", file=sys.stderr)
    print(completion.text)
    for call in completion.tool_calls:  # parsed out of the answer text: one JSON object per call
        print(json.dumps({"tool_call": {"name": call.name, "arguments": call.arguments}}, ensure_ascii=False))
    print(_report(llm, completion), file=sys.stderr)


def _report(llm, completion) -> str:
    import torch

    n = len(completion.token_ids)
    prefill_rate = completion.prompt_tokens / completion.ttft_s if completion.ttft_s else 0.0
    memory = f"\nmemory: {llm.engine.plan.describe(llm.engine.config.page_size)}"
    if llm.device.type == "cuda":
        memory += f", GPU peak {torch.cuda.max_memory_allocated(llm.device) / (1 << 30):.2f} GiB"
    spec = ""
    if completion.speculation is not None:
        st = completion.speculation
        per_position = " ".join(f"{p:.2f}" for p in st["acceptance_per_position"])
        spec = (f"\nspeculation: {st['rounds']} rounds, {st['accepted']}/{st['drafted']} drafts accepted "
                f"({100 * st['acceptance_rate']:.1f}%), {st['tokens_per_round']:.2f} tok/round, "
                f"per position [{per_position}]")
    return (f"prompt {completion.prompt_tokens} tok | generated {n} tok ({completion.finish_reason}) | "
            f"TTFT {completion.ttft_s * 1000:.1f} ms ({prefill_rate:.0f} tok/s prefill) | "
            f"decode {completion.decode_tokens_per_s:.1f} tok/s{spec}{memory}")


def run_ppl(args: argparse.Namespace) -> None:
    import ninfer

    if args.stride > args.context:
        raise CliError(f"--stride ({args.stride}) must not exceed --context ({args.context})")
    try:
        text = args.text.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"--text: file {args.text} not found") from None
    except UnicodeDecodeError as err:
        raise CliError(f"--text: {args.text} is not UTF-8 ({err})") from None
    llm = _load(args)
    result = ninfer.perplexity(llm, text, context=args.context, stride=args.stride)
    print(f"tokens {result.tokens}\nmean_nll {result.mean_nll:.6f}\nperplexity {result.perplexity:.4f}")
    if args.output:
        report = {"model": str(llm.model_dir), "text": str(args.text), "context": args.context,
                  "stride": args.stride, "tokens": result.tokens, "mean_nll": result.mean_nll,
                  "perplexity": result.perplexity, "windows": result.windows}
        args.output.write_text(json.dumps(report, indent=2))


def run_convert(args: argparse.Namespace) -> None:
    from ninfer.quant.recipe import list_recipes

    if args.list_recipes:
        for name, description in list_recipes():
            print(f"{name:28s} {description}")
        return
    for flag, value in (("SRC", args.src), ("--recipe", args.recipe), ("--out", args.out)):
        if not value:
            raise CliError(f"{flag} is required (or use --list-recipes)")
    from ninfer.quant.convert import convert_checkpoint

    out = convert_checkpoint(args.src, args.recipe, args.out, device=args.device)
    print(f"wrote {out}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from ninfer.checkpoint import CheckpointError
    from ninfer.config import ConfigError

    try:
        if args.command == "serve":
            from ninfer.api.cli import run_serve

            run_serve(args)
        else:
            {"generate": run_generate, "ppl": run_ppl, "convert": run_convert}[args.command](args)
    except (CliError, CheckpointError, ConfigError, ValueError) as err:
        print(f"ninfer: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
