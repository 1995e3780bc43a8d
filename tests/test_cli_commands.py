"""The ninfer commands of issue #23: streaming ``generate``, ``chat`` with piped stdin, ``warmup``, the sampling,
stop, template and serve flags, and readable help."""
from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

import ninfer
import ninfer.cli_stream
from cli_testing import requests  # noqa: F401  (fixture)
from cli_testing import run_cli
from ninfer.llm import LLM
from tiny_checkpoints import TinyCheckpoint

TEMPLATE = "{% for m in messages %}CUSTOM-{{ m.role }}: {{ m.content }}\n{% endfor %}ANSWER:"



@pytest.fixture
def chats(monkeypatch) -> list:
    """The conversation of every ``LLM.chat`` call (copied: the chat command keeps appending)."""
    seen: list = []
    real = LLM.chat

    def chat(self, messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(LLM, "chat", chat)
    return seen


def test_generate_streams_the_same_text_it_prints_at_the_end(capsys, monkeypatch, dense_ckpt: TinyCheckpoint) -> None:
    deltas: list[str] = []

    class Recording(ninfer.cli_stream.ReplyPrinter):
        def on_delta(self, delta) -> None:
            deltas.append(delta.text)
            super().on_delta(delta)

    monkeypatch.setattr("ninfer.cli.ReplyPrinter", Recording)
    args = ["generate", str(dense_ckpt.path), "--prompt", "Hello", "--max-new", "12", "--greedy", "--device", "cpu"]
    code, streamed, err = run_cli(capsys, *args, "--no-thinking")
    assert code == 0, err
    assert len([d for d in deltas if d]) > 1 and streamed == "".join(deltas) + "\n"
    deltas.clear()
    code, whole, err = run_cli(capsys, *args, "--no-thinking", "--no-stream")
    assert code == 0 and whole == streamed and not deltas
    code, thinking_out, thinking_err = run_cli(capsys, *args)
    code2, thinking_whole, thinking_whole_err = run_cli(capsys, *args, "--no-stream")
    assert thinking_out == thinking_whole and "[reasoning]" in thinking_err
    strip = re.compile(r"TTFT.*")  # timings differ between runs
    assert strip.sub("", thinking_err) == strip.sub("", thinking_whole_err)


def test_sampling_and_stop_flags_reach_the_requests(capsys, requests, dense_ckpt: TinyCheckpoint) -> None:
    code, _, err = run_cli(capsys, "generate", str(dense_ckpt.path), "--prompt", "hi", "--max-new", "3", "--device",
                           "cpu", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "7", "--min-p", "0.05",
                           "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "--repetition-penalty", "1.2",
                           "--seed", "11", "--stop-token-id", "5", "--stop-token-id", "9", "--stop", "zz")
    assert code == 0, err
    p = requests[0].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 7, 0.05, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert requests[0].stop_token_ids == frozenset({5, 9}) and requests[0].stop_strings == ("zz",)


def test_stop_token_id_stops_the_reply(capsys, requests, dense_ckpt: TinyCheckpoint) -> None:
    args = ["generate", str(dense_ckpt.path), "--prompt", "Hello", "--max-new", "8", "--greedy", "--device", "cpu",
            "--raw"]
    code, _, err = run_cli(capsys, *args)
    assert code == 0 and "generated 8 tok (length)" in err
    third = requests[-1].output_ids[2]
    code, _, err = run_cli(capsys, *args, "--stop-token-id", str(third))
    assert code == 0 and "(stop)" in err
    assert requests[-1].output_ids[-1] == third and len(requests[-1].output_ids) <= 3


def test_chat_template_file_replaces_the_tokenizers(capsys, requests, tmp_path: Path,
                                                    dense_ckpt: TinyCheckpoint) -> None:
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    code, _, err = run_cli(capsys, "generate", str(dense_ckpt.path), "--prompt", "hi there", "--max-new", "2",
                           "--device", "cpu", "--chat-template", str(template))
    assert code == 0, err
    llm_prompt = requests[-1].prompt_ids
    tokenizer = ninfer.load(dense_ckpt.path, device="cpu", progress=False).tokenizer
    assert tokenizer.decode(llm_prompt) == "CUSTOM-user: hi there\nANSWER:"
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--raw", "--chat-template", str(template))
    assert code == 2 and "--chat-template needs a chat (not --raw)" in err
    code, _, err = run_cli(capsys, "generate", "--prompt", "x", "--chat-template", str(tmp_path / "none.jinja"))
    assert code == 2 and "--chat-template: cannot read" in err


def test_chat_reads_turns_from_stdin(capsys, monkeypatch, chats, dense_ckpt: TinyCheckpoint) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n\nAgain\n/reset\nFresh start\n/exit\nnever read\n"))
    code, out, err = run_cli(capsys, "chat", str(dense_ckpt.path), "--device", "cpu", "--max-new", "4",
                             "--no-thinking", "--system", "Be brief.", "--greedy")
    assert code == 0, err
    assert [[m["role"] for m in c] for c in chats] == [
        ["system", "user"], ["system", "user", "assistant", "user"], ["system", "user"]]
    assert chats[1][2]["content"] and chats[1][2]["content"] in out  # the first answer, kept in the history
    assert chats[2][1]["content"] == "Fresh start"
    assert "(conversation reset)" in err and err.count(" tokens, ") == 3
    assert "\x1b[" not in out  # not a terminal: no ANSI codes


def test_chat_shows_or_hides_the_thinking(capsys, monkeypatch, dense_ckpt: TinyCheckpoint) -> None:
    argv = ["chat", str(dense_ckpt.path), "--device", "cpu", "--max-new", "4", "--greedy"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    code, _, err = run_cli(capsys, *argv)
    assert code == 0 and "[reasoning]" in err  # the tiny model never closes its think block
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    code, out, err = run_cli(capsys, *argv, "--hide-thinking")
    assert code == 0 and "[reasoning]" not in err and out.strip() == ""
    code, _, err = run_cli(capsys, *argv, "--hide-thinking", "--no-thinking")
    assert code == 2 and "--hide-thinking conflicts with --no-thinking" in err


def test_chat_dims_the_thinking_on_a_terminal(capsys, monkeypatch, dense_ckpt: TinyCheckpoint) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    code, out, err = run_cli(capsys, "chat", str(dense_ckpt.path), "--device", "cpu", "--max-new", "4", "--greedy")
    assert code == 0, err
    assert out.startswith(ninfer.cli_stream.DIM) and ninfer.cli_stream.RESET in out


def test_warmup_loads_reports_the_phases_and_exits(capsys, monkeypatch, dense_ckpt: TinyCheckpoint) -> None:
    loaded = []
    real = ninfer.load
    monkeypatch.setattr(ninfer, "load", lambda *a, **kw: loaded.append(real(*a, **kw)) or loaded[-1])
    code, out, err = run_cli(capsys, "warmup", str(dense_ckpt.path), "--device", "cpu", "--max-concurrency", "2",
                             "--max-context", "512")
    assert code == 0, err
    assert re.search(r"^load\s+\d+\.\d+ s$", out, re.M) and re.search(r"^decode \(1-2 lanes\)\s+\d+\.\d+ s$", out, re.M)
    assert "memory: KV pool" in out and "device cpu" in out
    cfg = loaded[0].engine.config
    assert (cfg.max_concurrency, cfg.max_context, cfg.warmup) == (2, 512, False)  # warm-up timed by the command
    assert loaded[0].engine.is_idle()


def test_serve_passes_engine_flags_names_template_and_log_level(monkeypatch, tmp_path: Path,
                                                                composite_ckpt: TinyCheckpoint) -> None:
    import logging

    import ninfer.api.app
    import ninfer.api.serve_ops

    made = {}
    monkeypatch.setattr(ninfer.api.app, "create_app",
                        lambda llm, config, **kw: made.update(kw, config=config, engine=llm.engine.config))
    monkeypatch.setattr(ninfer.api.serve_ops, "serve", lambda app, args: None)
    monkeypatch.setattr(logging.getLogger("ninfer"), "level", logging.NOTSET)  # restored after the test
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    from ninfer.cli import main

    main(["serve", str(composite_ckpt.path), "--device", "cpu", "--served-model-name", "a", "b", "--chat-template",
          str(template), "--log-level", "debug", "--min-p", "0.1", "--max-context", "256", "--max-concurrency", "2",
          "--no-prefix-cache", "--spec", "mtp", "--draft-tokens", "2"])
    assert made["served_model_names"] == ["a", "b"] and made["chat_template"] == TEMPLATE
    assert made["config"].sampling.min_p == 0.1 and made["config"].model_id is None
    engine = made["engine"]
    assert (engine.max_context, engine.max_concurrency, engine.prefix_cache, engine.draft_tokens) == (256, 2, False, 2)
    assert logging.getLogger("ninfer.api").getEffectiveLevel() == logging.DEBUG


def test_serve_name_flags_conflict(capsys) -> None:
    code, _, err = run_cli(capsys, "serve", "--served-model-name", "a", "--model-id", "b")
    assert code == 2 and "--served-model-name conflicts with --model-id" in err


def test_the_app_answers_to_every_served_name(dense_ckpt: TinyCheckpoint, tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from ninfer.api import ServerConfig, create_app

    llm = ninfer.load(dense_ckpt.path, device="cpu", progress=False, max_context=256)
    app = create_app(llm, ServerConfig(default_max_tokens=2), served_model_names=["main", "alias"],
                     chat_template=TEMPLATE)
    with TestClient(app) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["main", "alias"]
        assert client.get("/v1/models/alias").status_code == 200
        assert client.get("/v1/models/other").status_code == 404
        reply = client.post("/v1/chat/completions", json={"model": "alias", "messages": [
            {"role": "user", "content": "hi"}]}).json()
        assert reply["model"] == "alias"  # the name the request asked for
        tokens = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()["tokens"]
        assert llm.tokenizer.decode(tokens) == "CUSTOM-user: x\nANSWER:"  # the server renders with the override
    with pytest.raises(ValueError, match="served_model_names"):
        create_app(llm, served_model_names=[])


@pytest.mark.parametrize("command", ["generate", "chat", "ppl", "convert", "serve", "warmup"])
def test_help_is_readable(capsys, command: str) -> None:
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0 and "usage: ninfer " + command in out
    assert "%(" not in out and "None" not in out and "forced" not in out
    assert max(len(line) for line in out.splitlines()) <= 120
    if command in ("generate", "chat", "serve", "warmup"):
        assert re.search(r"--max-context N\s+most tokens per sequence, prompt \+ output\s+\(default\s+8192\)", out)


def test_chat_reports_a_turn_that_does_not_fit_and_goes_on(capsys, monkeypatch, chats,
                                                            dense_ckpt: TinyCheckpoint) -> None:
    long = " ".join(["word"] * 80)
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{long}\nshort\n"))
    code, _, err = run_cli(capsys, "chat", str(dense_ckpt.path), "--device", "cpu", "--max-new", "2",
                           "--no-thinking", "--max-context", "64")
    assert code == 0, err
    assert "but max_context is 64" in err and "the message is dropped" in err
    assert [[m["content"] for m in c] for c in chats] == [[long], ["short"]]  # the failed turn left no trace
    assert err.count(" tokens, ") == 1
