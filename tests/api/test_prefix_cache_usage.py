"""Through the server, a repeated conversation resumes from the prefix cache and usage says so."""
from __future__ import annotations

import httpx

import ninfer
from ninfer.runtime.prefix_cache import END_MARK_REACH
from api_testing import serve
from tiny_checkpoints import TinyCheckpoint


def test_cached_tokens_in_usage_and_metrics(dense_ckpt: TinyCheckpoint) -> None:
    llm = ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, prefix_cache=True, progress=False)
    messages = [{"role": "system", "content": "You are terse. " * 20}, {"role": "user", "content": "Hello there"}]
    with serve(llm) as server:
        client = server.openai()
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
        second = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # resumed at the assistant turn's start, the checkpoint that also stands in for the prompt's end
        n, cached = second.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens
        assert n - 1 - END_MARK_REACH <= cached < n
        assert second.choices[0].message.content == first.choices[0].message.content
        claude = server.anthropic()
        reply = claude.messages.create(model="m", max_tokens=4, system=messages[0]["content"],
                                       messages=[{"role": "user", "content": "Hello there"}])
        assert reply.usage.cache_read_input_tokens > 0
        metrics = httpx.get(f"{server.url}/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("ninfer_prefix_cache_hits_total ")]
    assert hits and float(hits[0].split()[1]) >= 2
