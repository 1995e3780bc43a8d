"""Command-line options shared by the ``ninfer`` commands: the engine's, generated from
:class:`~ninfer.runtime.engine_config.EngineConfig`, and the model, sampling and template flags.

The engine flags take their defaults, help, units and checks from the options in the config's field
metadata, and :func:`engine_options` checks the flags together (``--draft-tokens`` needs ``--spec``)
with the validator ``ninfer.load`` uses, so an error names the ``--flag``.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from ninfer.runtime.engine_config import EngineConfig
from ninfer.runtime.options import Option, OptionError

SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed")
LOG_LEVELS = ("debug", "info", "warning", "error")


class CliError(Exception):
    """A user error: printed as ``ninfer: error: ...`` with exit status 2, no traceback."""


def load_model(args: argparse.Namespace, **fixed: Any):
    """``ninfer.load`` of the command's model, model and engine flags (``fixed``: what the command sets)."""
    import ninfer

    return ninfer.load(args.model, device=args.device, dtype=args.dtype, **engine_options(args), **fixed)


class HelpFormatter(argparse.HelpFormatter):
    """Wraps the description to the terminal; keeps the epilog (examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("example"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def flag_error(flag: str, problem: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{flag} {problem}")


def positive(flag: str, lo: int = 1):
    """An argparse type: an integer >= ``lo``, errors naming ``flag``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise flag_error(flag, f"expects an integer, got {text!r}") from None
        if value < lo:
            raise flag_error(flag, f"must be >= {lo}, got {value}")
        return value
    return parse


def number(flag: str, lo: float, hi: float | None = None, lo_open: bool = False):
    """An argparse type: a number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), errors naming ``flag``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise flag_error(flag, f"expects a number, got {text!r}") from None
        if (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
            raise flag_error(flag, f"is out of range: {value}")
        return value
    return parse


def add_model_argument(p: argparse.ArgumentParser) -> None:
    """The optional positional ``MODEL`` every command takes."""
    p.add_argument("model", nargs="?", help="checkpoint directory or Hugging Face id (default: bundled tiny model)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="torch device, e.g. cuda, cuda:1, cpu (default: cuda if available)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="compute dtype (default: bf16 on GPU, fp32 on CPU)")


def _engine_type(opt: Option):
    def parse(text: str) -> Any:
        if text in opt.literals:
            return text
        try:
            value = opt.kind(text)
        except ValueError:
            expected = {int: "an integer", float: "a number"}.get(opt.kind, "a value")
            extra = "".join(f" or {v!r}" for v in opt.literals if v is not None)
            raise flag_error(opt.flag, f"expects {expected}{extra}, got {text!r}") from None
        try:
            return opt.validate(value, opt.flag)
        except OptionError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return parse


GIVEN = "engine_flags_given"  # the namespace attribute listing the engine flags given on the command line


class _Given(argparse.Action):
    """Stores the flag's value and notes that it was given: only given flags reach ``ninfer.load``, so that
    an option that needs another one is checked only when the user set it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, set()) | {self.dest})


def _engine_help(opt: Option) -> str:
    if opt.kind is bool:
        return opt.flag_help or opt.help
    return opt.help if opt.default is None else f"{opt.help} (default {opt.default})"


def add_engine_options(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One flag per engine option (``exclude``: options the command fixes itself)."""
    g = p.add_argument_group("engine (the keywords of ninfer.load; docs/cli.md)")
    for opt in EngineConfig.options():
        if opt.name in exclude:
            continue
        if opt.kind is bool:
            g.add_argument(opt.flag, dest=opt.name, action=_Given, nargs=0, const=not opt.default,
                           default=opt.default, help=_engine_help(opt))
            continue
        choices = [c for c in opt.choices if c is not None] if opt.choices else None
        g.add_argument(opt.flag, dest=opt.name, action=_Given, type=None if choices else _engine_type(opt),
                       choices=choices, default=opt.default, metavar=opt.metavar, help=_engine_help(opt))


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ninfer.load`` keywords of the engine flags the command has, checked together; a flag that
    needs another one fails naming both."""
    given = {name: getattr(args, name) for name in sorted(getattr(args, GIVEN, ()))}
    EngineConfig.from_options(given, label=lambda opt: opt.flag, caller="ninfer")
    return given


def _sampling_type(name: str, kind: type):
    flag = "--" + name.replace("_", "-")

    def parse(text: str) -> Any:
        from ninfer.runtime.sampling import SamplingParams  # the engine's checks, named by the flag

        try:
            value = kind(text)
        except ValueError:
            raise flag_error(flag, f"expects {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        try:
            SamplingParams(**{name: value})
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err).replace(name, flag, 1)) from None
        return value
    return parse


def add_sampling_options(p: argparse.ArgumentParser, title: str) -> None:
    """``--temperature`` ... ``--seed``, ``--greedy``, ``--stop`` and ``--stop-token-id`` (the names of the
    server's request fields), checked as the engine checks them."""
    s = p.add_argument_group(title)
    s.add_argument("--temperature", type=_sampling_type("temperature", float), metavar="T",
                   help="sampling temperature")
    s.add_argument("--top-p", type=_sampling_type("top_p", float), metavar="P", help="nucleus sampling mass, (0, 1]")
    s.add_argument("--top-k", type=_sampling_type("top_k", int), metavar="K",
                   help="sample among the K most likely tokens, 0 = all")
    s.add_argument("--min-p", type=_sampling_type("min_p", float), metavar="P",
                   help="drop tokens below this fraction of the top token's probability, [0, 1]")
    s.add_argument("--presence-penalty", type=_sampling_type("presence_penalty", float), metavar="X",
                   help="OpenAI presence penalty over generated tokens, [-2, 2]")
    s.add_argument("--frequency-penalty", type=_sampling_type("frequency_penalty", float), metavar="X",
                   help="OpenAI frequency penalty over generated tokens, [-2, 2]")
    s.add_argument("--repetition-penalty", type=_sampling_type("repetition_penalty", float), metavar="X",
                   help="Hugging Face repetition penalty over prompt and output (1 = off)")
    s.add_argument("--seed", type=_sampling_type("seed", int), metavar="N", help="sampling seed (default: random)")
    s.add_argument("--greedy", action="store_true", help="always take the most likely token")


def add_stop_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop at this text (repeatable)")
    p.add_argument("--stop-token-id", action="append", type=positive("--stop-token-id", 0), metavar="ID",
                   dest="stop_token_ids", help="also stop at this token id (repeatable)")
    p.add_argument("--min-tokens", type=positive("--min-tokens", 0), metavar="N",
                   help="generate at least N tokens before any stop (end-of-sequence, --stop, --stop-token-id) "
                        "may end the reply, at most --max-new")


def check_min_tokens(args: argparse.Namespace) -> None:
    """Before loading: ``--min-tokens`` above ``--max-new`` can never be met."""
    least, most = getattr(args, "min_tokens", None), getattr(args, "max_new", None)
    if least and most is not None and least > most:
        raise CliError(f"--min-tokens {least} is more than --max-new {most}")


def sampling_keywords(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given, as keywords of ``LLM.generate`` / ``LLM.chat``."""
    given = {name: getattr(args, name) for name in (*SAMPLING_FLAGS, "min_tokens")
             if getattr(args, name, None) is not None}
    return {**given, "greedy": bool(getattr(args, "greedy", False))}


def add_template_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="render chats with this Jinja template instead of the tokenizer's")


def read_chat_template(args: argparse.Namespace) -> str | None:
    """The text of ``--chat-template FILE`` (None without the flag); errors name the flag."""
    path: Path | None = getattr(args, "chat_template", None)
    if path is None:
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--chat-template: cannot read {path}: {err}") from None
    if not text.strip():
        raise ValueError(f"--chat-template: {path} is empty")
    return text


def add_log_level_option(p: argparse.ArgumentParser, default: str = "warning") -> None:
    p.add_argument("--log-level", choices=LOG_LEVELS, default=default,
                   help=f"what ninfer logs to stderr (default {default})")


def set_log_level(args: argparse.Namespace) -> None:
    """``--log-level`` for ninfer's loggers (``ninfer.*``), with a stderr handler unless the process has one."""
    level = args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s  %(levelname)s  %(message)s")
    logging.getLogger("ninfer").setLevel(level)


def needs(args: argparse.Namespace, flag: str, needed: str, ok: bool) -> None:
    """Fail naming both flags when ``flag`` was given without ``needed`` (``ok``: whether it was)."""
    if getattr(args, flag[2:].replace("-", "_"), None) not in (None, False) and not ok:
        raise ValueError(f"{flag} needs {needed}")
