"""Through the server, speculative decoding gives the plain outputs and reports its statistics."""
from __future__ import annotations

import httpx

import ninfer
from api_testing import serve
from tiny_checkpoints import TinyCheckpoint


def test_speculative_server_matches_plain_and_reports_drafts(composite_ckpt: TinyCheckpoint) -> None:
    messages = [{"role": "user", "content": "Count to ten, slowly."}]
    plain = ninfer.load(composite_ckpt.path, device="cpu", max_concurrency=2, progress=False)
    with serve(plain) as server:
        want = server.openai().chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    spec = ninfer.load(composite_ckpt.path, device="cpu", max_concurrency=2, progress=False, spec="mtp",
                       draft_tokens=3)
    with serve(spec) as server:
        got = server.openai().chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in server.openai().chat.completions.create(
            model="m", messages=messages, max_tokens=12, temperature=0, stream=True) if chunk.choices)
        metrics = httpx.get(f"{server.url}/metrics").text
    assert got.choices[0].message.content == want.choices[0].message.content == streamed
    details = got.usage.completion_tokens_details
    # Each round commits its accepted drafts plus one token of the target's; the first token is the prefill's.
    rounds = got.usage.completion_tokens - 1 - details.accepted_prediction_tokens
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == 3 * rounds
    assert want.usage.completion_tokens_details.accepted_prediction_tokens == 0
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("ninfer_spec_decode_")}
    assert values["ninfer_spec_decode_draft_tokens_total"] >= 3 * rounds
    assert values["ninfer_spec_decode_rounds_total"] >= rounds
