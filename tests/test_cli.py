"""The ninfer command: generate and ppl, their output streams, and flag errors."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import ninfer
from cli_testing import run_cli
from tiny_checkpoints import TinyCheckpoint




def test_generate_default_model_prints_answer_and_report(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("NINFER_HOME", str(tmp_path))
    code, out, err = run_cli(capsys, "generate", "--prompt", "Hello", "--max-new", "8", "--greedy", "--device", "cpu")
    assert code == 0, err
    assert "decode" in err and "tok/s" in err and "TTFT" in err
    again = run_cli(capsys, "generate", "--prompt", "Hello", "--max-new", "8", "--greedy", "--device", "cpu")
    assert again[1] == out  # greedy is deterministic


def test_generate_messages_file_and_raw(capsys, dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    msgs = tmp_path / "chat.json"
    msgs.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}))
    code, _, err = run_cli(capsys, "generate", str(dense_ckpt.path), "--messages", str(msgs), "--max-new", "4",
                        "--seed", "3", "--no-thinking")
    assert code == 0, err
    code, _, err = run_cli(capsys, "generate", str(dense_ckpt.path), "--prompt", "abc", "--raw", "--max-new", "4")
    assert code == 0, err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--max-new", "0"], "--max-new must be >= 1"),
    (["generate", "--prompt", "x", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["generate", "--messages", "/no/such/file.json"], "--messages: file /no/such/file.json not found"),
    (["ppl", "m", "--text", "t.txt", "--context", "8", "--stride", "9"], "--stride (9) must not exceed --context (8)"),
    (["generate", "--prompt", "x", "--spec", "mtp", "--draft-tokens", "9"], "--draft-tokens must be 1-7"),
    (["generate", "--prompt", "x", "--spec", "eagle"], "--spec: invalid choice"),
])
def test_flag_errors_name_the_flag(capsys, argv: list[str], message: str) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err


def test_bad_messages_json(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = run_cli(capsys, "generate", "--messages", str(bad))
    assert code == 2 and "--messages" in err and "not valid JSON" in err


def test_unknown_model_is_a_clean_error(capsys, tmp_path: Path) -> None:
    code, _, err = run_cli(capsys, "generate", str(tmp_path), "--prompt", "x")
    assert code == 2 and "config.json" in err and "Traceback" not in err


def test_ppl_prints_numbers_and_writes_report(capsys, dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("Some text to score, repeated. " * 10)
    report = tmp_path / "report.json"
    code, out, err = run_cli(capsys, "ppl", str(dense_ckpt.path), "--text", str(text), "--context", "32",
                          "--stride", "16", "--output", str(report), "--device", "cpu")
    assert code == 0, err
    data = json.loads(report.read_text())
    assert f"tokens {data['tokens']}" in out
    assert math.isclose(data["perplexity"], math.exp(data["mean_nll"]), rel_tol=1e-9)
    assert len(data["windows"]) > 1 and sum(w["tokens"] for w in data["windows"]) == data["tokens"]
    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False)
    assert data["tokens"] == len(llm.tokenizer.encode(text.read_text())) - 1


def test_generate_with_mtp_speculation_reports_its_statistics(capsys, composite_ckpt: TinyCheckpoint,
                                                              dense_ckpt: TinyCheckpoint) -> None:
    args = ["generate", str(composite_ckpt.path), "--prompt", "Hello", "--max-new", "12", "--greedy", "--device", "cpu"]
    code, plain, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "speculation" not in err
    code, out, err = run_cli(capsys, *args, "--spec", "mtp", "--draft-tokens", "2")
    assert code == 0, err
    assert out == plain
    assert "speculation:" in err and "drafts accepted" in err and "per position [" in err
    code, _, err = run_cli(capsys, "generate", str(dense_ckpt.path), "--prompt", "x", "--spec", "mtp", "--device", "cpu")
    assert code == 2 and "no mtp.* tensors" in err and "Traceback" not in err
