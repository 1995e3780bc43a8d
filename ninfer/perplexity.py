"""Perplexity of a text under a loaded model, with fixed-size sliding windows."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

if TYPE_CHECKING:
    from ninfer.llm import LLM


@dataclass
class PerplexityResult:
    mean_nll: float
    perplexity: float
    tokens: int  # tokens scored (all but the first)
    windows: list[dict[str, Any]] = field(default_factory=list)


def perplexity(llm: LLM, text: str, context: int = 4096, stride: int = 2048, *,
               progress: bool = True) -> PerplexityResult:
    """``exp(mean NLL)`` over every token after the first, each scored once (see :meth:`LLM.score`)."""
    token_ids = llm.tokenizer.encode(text)
    if len(token_ids) < 2:
        raise ValueError(f"the text has {len(token_ids)} token(s); perplexity needs at least 2")
    total_nll, count, windows = 0.0, 0, []
    n_windows = max(1, math.ceil((len(token_ids) - context) / stride) + 1) if len(token_ids) > context else 1
    for w in tqdm(llm.score_windows(token_ids, context, stride), total=n_windows, desc="scoring",
                  unit="window", disable=not progress or None):
        nll = -float(w.logprobs.double().sum())
        total_nll += nll
        count += w.logprobs.numel()
        windows.append({"start": w.start, "end": w.end, "first_target": w.first_target,
                        "tokens": w.logprobs.numel(), "mean_nll": nll / w.logprobs.numel(),
                        "perplexity": math.exp(nll / w.logprobs.numel())})
    mean = total_nll / count
    return PerplexityResult(mean_nll=mean, perplexity=math.exp(mean), tokens=count, windows=windows)
