"""``ninfer generate``'s structured-output flags: ``--json-schema FILE``, ``--json-object``, ``--regex``,
``--choice`` (repeatable) and ``--grammar FILE``, turned into one ``ninfer.runtime.structured.Constraint``."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

FLAGS = ("--json-schema", "--json-object", "--regex", "--choice", "--grammar")


def add_structured_options(p: argparse.ArgumentParser) -> None:
    """Add the constraint flags (at most one may be given) to the ``generate`` parser."""
    g = p.add_argument_group("structured output (needs `pip install ninfer[structured]`; one of)")
    g.add_argument("--json-schema", type=Path, metavar="FILE", help="answer with JSON matching this JSON Schema")
    g.add_argument("--json-object", action="store_true", help="answer with a JSON object")
    g.add_argument("--regex", metavar="PATTERN", help="answer with text matching this regular expression")
    g.add_argument("--choice", action="append", metavar="TEXT", help="answer with one of these strings (repeatable)")
    g.add_argument("--grammar", type=Path, metavar="FILE", help="answer with text of this EBNF/GBNF grammar")


def constraint_from_args(args: argparse.Namespace) -> Any:
    """The ``Constraint`` the flags ask for, or None; errors (two flags, unreadable file, bad schema) name
    the flag. Imported lazily: ``--help`` stays fast."""
    from ninfer.runtime.structured import Constraint, StructuredError

    given = [flag for flag in FLAGS if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]
    if len(given) > 1:
        raise StructuredError(f"{given[1]} conflicts with {given[0]}: give one output constraint", given[1])
    if not given:
        return None
    flag = given[0]
    if flag == "--json-object":
        return Constraint.json_object(flag)
    if flag == "--regex":
        return Constraint.regex(args.regex, flag)
    if flag == "--choice":
        return Constraint.choice(args.choice, flag)
    path: Path = args.json_schema if flag == "--json-schema" else args.grammar
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise StructuredError(f"{flag}: cannot read {path}: {err}", flag) from None
    return Constraint.json_schema(text, flag) if flag == "--json-schema" else Constraint.grammar(text, flag)
