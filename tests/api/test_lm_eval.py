"""lm-evaluation-harness (``local-completions``, unmodified) against the server on loopback.

Two tiny tasks from local JSON files (no dataset download): a multiple-choice one (loglikelihood
requests: ``echo`` + ``logprobs`` on token-id prompts) and a generation one (``generate_until``).
The harness finds ``/tokenizer_info`` and tokenizes through ``/tokenize`` / ``/detokenize``. Each
loglikelihood is checked against the model's own scores from a second load of the checkpoint, and
each generation against the Python API's greedy generation.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

import ninfer

from tiny_checkpoints import TinyCheckpoint

DOCS = [{"q": "Two plus two is", "choices": [" four", " five", " blue"], "label": 0},
        {"q": "The sky is", "choices": [" green", " blue"], "label": 1},
        {"q": "Cats say", "choices": [" meow", " moo", " quack"], "label": 0}]
TASKS = {
    "ninfer_tiny_mc": {"output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{choices}}",
                       "doc_to_target": "{{label}}", "metric_list": [{"metric": "acc"}]},
    "ninfer_tiny_gen": {"output_type": "generate_until", "doc_to_text": "{{q}}", "doc_to_target": "{{choices[0]}}",
                        "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 5, "do_sample": False},
                        "metric_list": [{"metric": "exact_match"}]},
}


@pytest.fixture(scope="module")
def ref(dense_ckpt: TinyCheckpoint) -> ninfer.LLM:
    return ninfer.load(dense_ckpt.path, device="cpu", max_concurrency=2, progress=False)


def _task_dir(tmp_path: Path) -> Path:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, spec in TASKS.items():
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", **spec}
        (tmp_path / f"{name}.yaml").write_text(json.dumps(config))  # YAML is a superset of JSON
    return tmp_path


def _loglikelihood(ref: ninfer.LLM, context: str, continuation: str) -> float:
    """The continuation's log-probability, tokenized as the harness does (trailing blanks of the context move
    to the continuation; the continuation's tokens are those past the context's in the whole)."""
    blanks = len(context) - len(context.rstrip())
    if blanks:
        context, continuation = context[:-blanks], context[-blanks:] + continuation
    whole = ref.tokenizer.encode(context + continuation)
    start = len(ref.tokenizer.encode(context))
    ref.runner.start(len(whole))
    with torch.no_grad():
        logits = ref.model.logits(ref.runner.extend(whole)[:-1]).float()[:, :ref.valid_vocab]
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(whole[1:])[:, None])[:, 0]
    return float(lp[start - 1:].sum())


def test_lm_eval_local_completions(server, ref: ninfer.LLM, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate  # the dev extra pins lm-eval[api]
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(_task_dir(tmp_path)), include_defaults=False)
    results = simple_evaluate(model="local-completions",
                              model_args={"model": "tiny", "base_url": server.url + "/v1/completions",
                                          "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True},
                              tasks=list(TASKS), task_manager=manager, limit=3, log_samples=True)
    assert results is not None
    mc = results["samples"]["ninfer_tiny_mc"]
    assert len(mc) == 3
    for sample in mc:
        assert len(sample["resps"]) == len(sample["arguments"])
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ll, _greedy = resp[0]  # one (loglikelihood, is_greedy) per request
            assert float(ll) == pytest.approx(_loglikelihood(ref, context, continuation), abs=2e-3)
    gen = results["samples"]["ninfer_tiny_gen"]
    assert len(gen) == 3
    for sample in gen:
        context = sample["arguments"][0][0]
        want = ref.generate({"prompt_token_ids": ref.tokenizer.encode(context)},
                            ninfer.SamplingParams(max_tokens=5, temperature=0, stop=["\n", "."]))[0].outputs[0].text
        assert sample["resps"][0][0] == want
    assert 0.0 <= results["results"]["ninfer_tiny_mc"]["acc,none"] <= 1.0
    metrics = httpx.get(server.url + "/metrics").text  # the harness tokenized through the server
    assert 'route="/tokenize",status="200"' in metrics and 'route="/tokenizer_info",status="200"' in metrics
