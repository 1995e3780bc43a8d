"""``ninfer generate``'s structured-output flags: the answer conforms, and flag errors name the flag."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cli_testing import run_cli
from tiny_checkpoints import TinyCheckpoint

pytest.importorskip("xgrammar")




def test_constraint_flags_shape_the_answer(capsys, dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "<" [a-c] [a-c]? ">"\n')
    model = str(dense_ckpt.path)
    base = ("generate", model, "--prompt", "hi", "--no-thinking", "--max-new", "24", "--seed", "2", "--device", "cpu")
    for flags, check in ((["--json-schema", str(schema)], lambda s: json.loads(s) in ({"ok": True}, {"ok": False})),
                         (["--choice", "alpha", "--choice", "beta"], lambda s: s in ("alpha", "beta")),
                         (["--regex", "[xyz]{2}[0-9]"], lambda s: re.fullmatch("[xyz]{2}[0-9]", s)),
                         (["--grammar", str(grammar)], lambda s: re.fullmatch("<[a-c][a-c]?>", s))):
        code, out, err = run_cli(capsys, *base, *flags)
        assert code == 0, err
        assert check(out.rstrip("\n")), (flags, out)
    code, out, err = run_cli(capsys, "generate", model, "--prompt", "x", "--raw", "--json-object", "--max-new", "6",
                          "--device", "cpu")
    assert code == 0 and out.startswith("{"), err


@pytest.mark.parametrize("flags, message", [
    (["--regex", "a", "--choice", "b"], "--choice conflicts with --regex"),
    (["--json-schema", "/no/such.json"], "--json-schema: cannot read /no/such.json"),
    (["--regex", "a("], "'--regex': the regular expression cannot be compiled"),
])
def test_constraint_flag_errors_name_the_flag(capsys, dense_ckpt: TinyCheckpoint, flags: list[str],
                                              message: str) -> None:
    code, _, err = run_cli(capsys, "generate", str(dense_ckpt.path), "--prompt", "x", "--max-new", "2",
                        "--device", "cpu", *flags)
    assert code == 2 and message in err, err


def test_unsupported_schema_keyword_names_the_flag(capsys, tmp_path: Path) -> None:
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--json-schema", str(schema))
    assert code == 2 and "'--json-schema.uniqueItems'" in err, err
