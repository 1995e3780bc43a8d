"""The ``ninfer`` command: ``generate``, ``chat``, ``ppl``, ``convert``, ``serve``, ``warmup`` and ``token-map``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ninfer.cli_options import (
    CliError,
    HelpFormatter,
    add_engine_options,
    add_log_level_option,
    add_model_argument,
    add_model_options,
    add_sampling_options,
    add_stop_options,
    add_template_option,
    check_min_tokens,
    engine_options,
    load_model,
    needs,
    positive,
    read_chat_template,
    sampling_keywords,
    set_log_level,
)
from ninfer.cli_stream import ReplyPrinter, report
from ninfer.cli_structured import add_structured_options, constraint_from_args

GENERATE_EXAMPLES = """examples:
  ninfer generate --prompt "Why is the sky blue?"            # bundled tiny default model
  ninfer generate Qwen/Qwen3.6-27B --prompt "Hi" --no-thinking --max-new 64
  ninfer generate ./my-model --messages chat.json --greedy
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ninfer", description="Fast inference for the Qwen3.5 model family.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate a reply to a prompt or a chat",
                         description="Generate a reply. The answer goes to stdout; reasoning, timings and "
                                     "tok/s go to stderr.", epilog=GENERATE_EXAMPLES,
                         formatter_class=HelpFormatter)
    add_model_argument(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="user message text (rendered with the chat template)")
    source.add_argument("--messages", type=Path, metavar="FILE",
                        help="JSON file: a list of chat messages, or {\"messages\": [...], \"tools\": [...]}")
    gen.add_argument("--raw", action="store_true", help="send --prompt as raw text, without the chat template")
    gen.add_argument("--max-new", type=positive("--max-new"), default=256, metavar="N",
                     help="maximum number of generated tokens (default 256)")
    gen.add_argument("--no-thinking", action="store_true", help="turn the model's reasoning phase off")
    gen.add_argument("--no-stream", action="store_true",
                     help="print the reply when it is complete (default: as the tokens arrive)")
    gen.add_argument("--vision", action="store_true",
                     help="load the vision tower; --messages may hold image_url / video_url parts")
    add_template_option(gen)
    add_log_level_option(gen)
    add_sampling_options(gen, "sampling (default: the model's generation_config.json and preset)")
    add_stop_options(gen)
    add_structured_options(gen)
    add_model_options(gen)
    add_engine_options(gen, exclude=("max_concurrency",))  # one sequence
    gen.set_defaults(func=run_generate)

    from ninfer.cli_chat import add_chat_parser, add_warmup_parser

    add_chat_parser(sub)

    ppl = sub.add_parser("ppl", help="perplexity of a text file",
                         description="Score a UTF-8 text file with sliding windows and print tokens, mean NLL "
                                     "and perplexity.",
                         epilog="example:\n  ninfer ppl ./my-model --text wiki.txt --context 4096 --stride 2048 "
                                "--output report.json", formatter_class=HelpFormatter)
    add_model_argument(ppl)
    ppl.add_argument("--text", type=Path, required=True, metavar="FILE", help="UTF-8 text to score")
    ppl.add_argument("--context", type=positive("--context"), default=4096, metavar="N",
                     help="window length in tokens (default 4096)")
    ppl.add_argument("--stride", type=positive("--stride"), default=2048, metavar="N",
                     help="window advance in tokens (default 2048)")
    ppl.add_argument("--output", type=Path, metavar="FILE", help="write a JSON report with per-window numbers")
    add_model_options(ppl)
    ppl.set_defaults(func=run_ppl)

    conv = sub.add_parser("convert", help="quantize a bf16 checkpoint with a recipe",
                          description="Quantize a Hugging Face bf16 checkpoint tensor by tensor into a ninfer "
                                      "checkpoint directory (safetensors + ninfer.json) that ninfer.load reads "
                                      "without repacking.",
                          epilog="examples:\n  ninfer convert --list-recipes\n"
                                 "  ninfer convert ./Qwen3.6-27B --recipe qwen3_5_27b_int4 --out ./Qwen3.6-27B-int4",
                          formatter_class=HelpFormatter)
    conv.add_argument("src", nargs="?", help="bf16 checkpoint directory or Hugging Face id")
    conv.add_argument("--recipe", metavar="NAME_OR_FILE", help="a shipped recipe name or a recipe JSON file")
    conv.add_argument("--out", type=Path, metavar="DIR", help="output directory (must not exist or be empty)")
    conv.add_argument("--device", help="where to quantize (default: cuda if available)")
    conv.add_argument("--list-recipes", action="store_true", help="list the shipped recipes and exit")
    conv.set_defaults(func=run_convert)

    from ninfer.api.cli import add_serve_parser

    add_serve_parser(sub)
    add_warmup_parser(sub)
    from ninfer.cli_token_map import add_token_map_parser

    add_token_map_parser(sub)
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


def run_generate(args: argparse.Namespace) -> None:
    set_log_level(args)
    if args.raw and args.messages:
        raise CliError("--raw applies to --prompt only")
    needs(args, "--chat-template", "a chat (not --raw)", not args.raw)
    constraint = constraint_from_args(args)  # before loading: a bad flag fails fast
    engine_options(args)  # likewise
    check_min_tokens(args)
    messages, tools = _read_messages(args.messages) if args.messages else (
        [{"role": "user", "content": args.prompt}], None)
    if args.messages:
        from ninfer.vision import rebase_local_paths

        messages = rebase_local_paths(messages, args.messages.parent)  # media paths relative to the file
    llm = load_model(args, max_concurrency=1, vision=args.vision, chat_template=read_chat_template(args))
    printer = ReplyPrinter("stderr")
    sampling = dict(max_new_tokens=args.max_new, stop=args.stop, stop_token_ids=args.stop_token_ids,
                    structured=constraint, on_delta=None if args.no_stream else printer.on_delta,
                    **sampling_keywords(args))
    if args.raw:
        completion = llm.generate(args.prompt, **sampling)
    else:
        completion = llm.chat(messages, tools=tools, enable_thinking=not args.no_thinking, **sampling)
    if args.no_stream:
        printer.whole(completion)
    printer.close(completion)
    print(report(llm, completion), file=sys.stderr)


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
    llm = load_model(args)
    result = ninfer.perplexity(llm, text, context=args.context, stride=args.stride)
    print(f"tokens {result.tokens}\nmean_nll {result.mean_nll:.6f}\nperplexity {result.perplexity:.4f}")
    if args.output:
        summary = {"model": str(llm.model_dir), "text": str(args.text), "context": args.context,
                   "stride": args.stride, "tokens": result.tokens, "mean_nll": result.mean_nll,
                   "perplexity": result.perplexity, "windows": result.windows}
        args.output.write_text(json.dumps(summary, indent=2))


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
        args.func(args)
    except (CliError, CheckpointError, ConfigError, ValueError) as err:
        print(f"ninfer: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
