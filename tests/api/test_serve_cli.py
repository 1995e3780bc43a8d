"""``ninfer serve``: flags map onto the server config, and ``python -m ninfer.api.cli serve`` serves."""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ninfer.api.cli import add_serve_parser, server_config

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_flags_map_onto_the_server_config() -> None:
    args = _parse("m", "--api-key", "k", "--model-id", "alias", "--max-pending", "3", "--pending-timeout-ms", "250",
                  "--max-request-mib", "2", "--default-max-tokens", "99", "--no-thinking", "--preserve-thinking",
                  "--cors", "--temperature", "0.3", "--top-k", "5", "--presence-penalty", "1.5", "--seed", "4",
                  "--greedy", "--kv-capacity", "auto", "--max-concurrency", "2", "--host-prepin-gib", "0.5")
    config = server_config(args)
    assert (config.api_key, config.model_id, config.max_pending, config.pending_timeout_ms) == ("k", "alias", 3, 250)
    assert config.max_request_bytes == 2 << 20 and config.default_max_tokens == 99
    assert not config.thinking and config.preserve_thinking and config.cors
    s = config.sampling
    assert (s.temperature, s.top_k, s.presence_penalty, s.seed, s.greedy) == (0.3, 5, 1.5, 4, True)
    assert args.kv_capacity == "auto" and args.max_concurrency == 2 and args.func.__name__ == "run_serve"
    assert args.host_prepin_gib == 0.5 and _parse("m").host_prepin_gib == 0.0
    assert _parse("m").switch_interval_ms == 0.5 and _parse("m", "--switch-interval-ms", "2").switch_interval_ms == 2
    defaults = server_config(_parse())
    assert defaults.max_pending == 16 and defaults.pending_timeout_ms == 30000 and defaults.thinking


@pytest.mark.parametrize("argv", [["--max-concurrency", "0"], ["--top-p", "0"], ["--temperature", "hot"],
                                  ["--kv-capacity", "lots"], ["--draft-tokens", "8"], ["--spec", "eagle"],
                                  ["--host-prepin-gib", "-1"], ["--switch-interval-ms", "0"]])
def test_bad_flags_are_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        _parse("m", *argv)
    assert argv[0] in capsys.readouterr().err


def test_module_entry_point_serves(dense_ckpt) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "ninfer.api.cli", "serve", str(dense_ckpt.path), "--port", str(port),
                             "--device", "cpu", "--max-context", "256", "--api-key", "k", "--default-max-tokens", "3",
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        r = httpx.post(url + "/v1/chat/completions", headers={"authorization": "Bearer k"}, timeout=30,
                       json={"model": "x", "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["model"] == "x"  # the name asked for (any name is served)
        assert r.json()["usage"]["completion_tokens"] <= 3
        models = httpx.get(url + "/v1/models", headers={"x-api-key": "k"}).json()
        assert models["data"][0]["max_model_len"] == 256 and models["data"][0]["id"] == dense_ckpt.path.name
    finally:
        proc.terminate()
        proc.wait(timeout=20)
