"""/v1/completions on CUDA: the prompt is scored on the engine thread between CUDA-graph decode steps of
other requests (echo + logprobs), and n samples share the prompt's prefill; lanes and pages end free."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import ninfer
from ninfer.api import ServerConfig
from tiny_checkpoints import make_composite

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
from api_testing import serve, wait_idle  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
PROMPT = list(range(20, 60))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_echo_logprobs_and_n_beside_running_decodes(tmp_path: Path, dtype: torch.dtype) -> None:
    ckpt = make_composite(tmp_path, seed=5)
    llm = ninfer.load(ckpt.path, device="cuda", dtype=dtype, max_concurrency=4, progress=False)
    with serve(llm, ServerConfig(model_id="tiny")) as s:
        client = s.openai()
        busy = threading.Thread(target=lambda: client.completions.create(model="tiny", prompt=[5, 6, 7],
                                                                         max_tokens=64, temperature=0))
        busy.start()  # decode steps (CUDA graphs) run while the prompt below is scored
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
        many = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, n=3)
        busy.join()
        wait_idle(llm)
    got = torch.tensor(out.choices[0].logprobs.token_logprobs[1:])
    llm.runner.start(len(PROMPT))
    with torch.no_grad():
        logits = llm.model.logits(llm.runner.extend(PROMPT)[:-1]).float()[:, :llm.valid_vocab]
    want = logits.log_softmax(-1).gather(-1, torch.tensor(PROMPT[1:], device=logits.device)[:, None])[:, 0].cpu()
    assert torch.allclose(got, want, atol=1e-3 if dtype == torch.float32 else 5e-2)
    assert len({c.text for c in many.choices}) == 1  # greedy samples from the shared prefill agree
    assert many.usage.prompt_tokens == len(PROMPT)
