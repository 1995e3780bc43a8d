"""Fixtures of the API tests: the tiny model, a shared server, and a server over a scripted engine."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from api_testing import ScriptedEngine, Server, serve
from tiny_checkpoints import TinyCheckpoint

import ninfer
from ninfer.api import ServerConfig


@pytest.fixture(scope="session")
def llm(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)


@pytest.fixture(scope="session")
def server(llm: ninfer.LLM) -> Iterator[Server]:
    with serve(llm, ServerConfig(default_max_tokens=8, model_id="tiny")) as s:
        yield s


@pytest.fixture()
def oai(server: Server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture()
def anth(server: Server) -> anthropic.Anthropic:
    return server.anthropic()


@pytest.fixture(scope="module")
def scripted(llm: ninfer.LLM) -> Iterator[tuple[Server, ScriptedEngine]]:
    engine = ScriptedEngine(llm)
    with serve(llm, ServerConfig(default_max_tokens=8, model_id="tiny"), engine=engine) as s:
        yield s, engine
