"""``ninfer generate``'s structured-output flags: the answer conforms, and flag errors name the flag."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ninfer.cli import main
from tiny_checkpoints import TinyCheckpoint

pytest.importorskip("xgrammar")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


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
        code, out, err = _run(capsys, *base, *flags)
        assert code == 0, err
        assert check(out.rstrip("\n")), (flags, out)
    code, out, err = _run(capsys, "generate", model, "--prompt", "x", "--raw", "--json-object", "--max-new", "6",
                          "--device", "cpu")
    assert code == 0 and out.startswith("{"), err


@pytest.mark.parametrize("flags, message", [
    (["--regex", "a", "--choice", "b"], "--choice conflicts with --regex"),
    (["--json-schema", "/no/such.json"], "--json-schema: cannot read /no/such.json"),
    (["--regex", "a("], "'--regex': the regular expression cannot be compiled"),
])
def test_constraint_flag_errors_name_the_flag(capsys, dense_ckpt: TinyCheckpoint, flags: list[str],
                                              message: str) -> None:
    code, _, err = _run(capsys, "generate", str(dense_ckpt.path), "--prompt", "x", "--max-new", "2",
                        "--device", "cpu", *flags)
    assert code == 2 and message in err, err


def test_unsupported_schema_keyword_names_the_flag(capsys, tmp_path: Path) -> None:
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    code, _, err = _run(capsys, "generate", "--prompt", "x", "--json-schema", str(schema))
    assert code == 2 and "'--json-schema.uniqueItems'" in err, err
