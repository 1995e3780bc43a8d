"""``ninfer chat MODEL``: a multi-turn conversation on the terminal, and ``ninfer warmup MODEL``: build the
engine with its warm-up and report the phases' times, so a deployment fills its caches ahead of serving.

The chat reads one user message per line of stdin (so it runs with piped input as well as typed), keeps
the history, and knows ``/reset`` (forget the history) and ``/exit`` (or end of input).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ninfer.cli_options import (
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
    positive,
    read_chat_template,
    sampling_keywords,
    set_log_level,
)
from ninfer.cli_stream import ReplyPrinter

CHAT_EXAMPLES = """examples:
  ninfer chat                                            # bundled tiny default model
  ninfer chat Qwen/Qwen3.6-27B --hide-thinking --system "Answer briefly."
  printf 'Hi\\n/reset\\nWho are you?\\n' | ninfer chat ./my-model --no-thinking

commands (typed as a message): /reset forgets the conversation, /exit (or end of input) quits
"""
WARMUP_EXAMPLES = """examples:
  ninfer warmup Qwen/Qwen3.6-27B --max-concurrency 4 --max-context 32768   # same flags as serve
  NINFER_TUNE_CACHE=/cache/tune TRITON_CACHE_DIR=/cache/triton ninfer warmup ./my-model
"""
COMMANDS = ("/reset", "/exit", "/quit")


def add_chat_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("chat", help="talk with a model on the terminal (multi-turn)",
                       description="Interactive multi-turn chat: one message per line of stdin; the answer "
                                   "streams to stdout, thinking is shown dimmed (on stderr when stdout is not a "
                                   "terminal) unless --hide-thinking.",
                       epilog=CHAT_EXAMPLES, formatter_class=HelpFormatter)
    add_model_argument(p)
    p.add_argument("--system", metavar="TEXT", help="system message at the start of the conversation")
    p.add_argument("--max-new", type=positive("--max-new"), default=1024, metavar="N",
                   help="maximum number of generated tokens per reply (default 1024)")
    p.add_argument("--no-thinking", action="store_true", help="turn the model's reasoning phase off")
    p.add_argument("--hide-thinking", action="store_true", help="think, but do not print the thinking")
    add_template_option(p)
    add_log_level_option(p)
    add_sampling_options(p, "sampling (default: the model's generation_config.json and preset)")
    add_stop_options(p)
    add_model_options(p)
    add_engine_options(p, exclude=("max_concurrency",))  # one conversation
    p.set_defaults(func=run_chat)
    return p


def run_chat(args: argparse.Namespace, stdin: Any = None) -> None:
    set_log_level(args)
    if args.hide_thinking and args.no_thinking:
        raise ValueError("--hide-thinking conflicts with --no-thinking: with thinking off there is none to hide")
    engine_options(args)  # before loading: a bad flag fails fast
    check_min_tokens(args)
    stdin = stdin or sys.stdin
    llm = load_model(args, max_concurrency=1, chat_template=read_chat_template(args))
    sampling = dict(max_new_tokens=args.max_new, stop=args.stop, stop_token_ids=args.stop_token_ids,
                    **sampling_keywords(args))
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    mode = "hide" if args.hide_thinking else "dim" if sys.stdout.isatty() else "stderr"
    typed = stdin.isatty()
    while True:
        if typed:
            print(">>> ", end="", file=sys.stderr, flush=True)
        line = stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            history = list(start)
            print("(conversation reset)", file=sys.stderr)
            continue
        if text.startswith("/") and " " not in text.strip():
            print(f"unknown command {text.strip()}: {', '.join(COMMANDS)}; a message starting with '/' needs "
                  "a space in it", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        printer = ReplyPrinter(mode)
        try:
            completion = llm.chat(history, enable_thinking=not args.no_thinking, on_delta=printer.on_delta,
                                  **sampling)
        except ValueError as err:  # e.g. the conversation outgrew --max-context: this turn is dropped
            history.pop()
            printer.abandon()
            print(f"ninfer: error: {err} (the message is dropped; /reset starts a new conversation)",
                  file=sys.stderr)
            continue
        printer.close(completion)
        history.append({"role": "assistant", "content": completion.text})
        print(f"({len(completion.token_ids)} tokens, {completion.finish_reason}, "
              f"{completion.decode_tokens_per_s:.1f} tok/s)", file=sys.stderr)


def add_warmup_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("warmup", help="build the engine with its warm-up and exit (fills the kernel caches)",
                       description="Load the model and build the engine as `ninfer serve` would with the same "
                                   "flags, compile and autotune the kernels (on CUDA; Triton's compile cache "
                                   "and ninfer's tuning cache keep the results), run one short decode per "
                                   "lane count, print each phase's time and exit. On CPU it loads and reports.",
                       epilog=WARMUP_EXAMPLES, formatter_class=HelpFormatter)
    add_model_argument(p)
    add_log_level_option(p)
    add_model_options(p)
    add_engine_options(p, exclude=("warmup",))  # that is what the command does
    p.set_defaults(func=run_warmup)
    return p


def run_warmup(args: argparse.Namespace) -> None:
    set_log_level(args)
    engine_options(args)
    t0 = time.perf_counter()
    llm = load_model(args, warmup=False)  # the warm-up runs below, timed apart from loading
    times = {"load": time.perf_counter() - t0}
    cuda = llm.device.type == "cuda"
    if cuda:
        t0 = time.perf_counter()
        llm.engine.warm_up()
        _sync(llm)
        times["warm-up (prefill kernels)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lanes = llm.engine.config.max_concurrency
    for n in range(1, lanes + 1):  # each decode batch size serving meets (its GEMV configs tune per M)
        llm.generate(["warm-up"] * n, max_new_tokens=4, ignore_eos=True, greedy=True)
    _sync(llm)
    times[f"decode (1-{lanes} lanes)"] = time.perf_counter() - t0
    for phase, seconds in times.items():
        print(f"{phase:28s} {seconds:8.2f} s")
    print(f"memory: {llm.engine.plan.describe(llm.engine.config.page_size)}")
    print(_caches(llm.device))


def _sync(llm: Any) -> None:
    if llm.device.type == "cuda":
        import torch

        torch.cuda.synchronize(llm.device)


def _caches(device: Any) -> str:
    if device.type != "cuda":
        return f"device {device}: nothing to compile or tune; the checkpoint loads as it will when serving"
    import os

    from ninfer.kernels.tune_cache import cache_dir

    tune = cache_dir()
    triton = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return (f"tuning cache: {tune if tune is not None else 'off (NINFER_TUNE_CACHE)'}\n"
            f"Triton compile cache: {triton}")
