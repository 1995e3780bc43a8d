"""``ninfer.SamplingParams``: vLLM's sampling parameters, for ``LLM.generate`` / ``chat`` and the async API.

It extends the engine's :class:`ninfer.runtime.sampling.SamplingParams` (what the sampler reads per
lane) with what belongs to a request: the token budget, stops, the number of samples. Field names
are vLLM's; every field is honoured, and vLLM fields the engine cannot honour are absent (the
constructor's TypeError names them).
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from ninfer.runtime.sampling import SamplingParams as EngineSamplingParams
from ninfer.runtime.sampling import check_stop_strings

MAX_SAMPLES = 64  # n: samples of one prompt (each takes an engine lane while it runs)


@dataclass(frozen=True)
class SamplingParams(EngineSamplingParams):
    """How to sample, how much, and when to stop (vLLM's names and defaults: ``max_tokens=16``).

    ``temperature=0`` (or ``greedy=True``) is greedy; ``top_k`` 0 or -1 is off. ``max_tokens=None``
    generates until a stop or the context's end. ``stop`` strings are cut from the text;
    ``stop_token_ids`` stop after that token. ``thinking_budget`` (chats with thinking on) closes the reasoning with ``</think>`` after that many
    tokens. ``ignore_eos`` keeps generating past the model's
    end-of-sequence tokens (``stop`` and ``stop_token_ids`` still apply). ``min_tokens`` tokens come
    before any stop can end the output (end-of-sequence and ``stop_token_ids`` are never sampled before,
    ``stop`` strings completed before do not match). ``n`` samples share the
    prompt's prefill through the prefix cache. ``logprobs=k`` reports each token's log-probability
    and the ``k`` most likely alternatives. With ``seed`` the ``n`` samples are reproducible (sample
    ``i > 0`` draws from a seed derived from ``(seed, i)``).
    """

    max_tokens: int | None = 16
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.top_k == -1:  # vLLM's "off"
            object.__setattr__(self, "top_k", 0)
        super().__post_init__()
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_SAMPLES:
            raise ValueError(f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        check_stop_strings(stops)  # non-empty strings, bounded in length and in all (the matcher's memory)
        object.__setattr__(self, "stop", tuple(stops))
        ids = list(self.stop_token_ids or ())
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")

    @classmethod
    def from_engine(cls, params: EngineSamplingParams, **request: Any) -> SamplingParams:
        """These parameters from the engine's kind (e.g. ``LLM.sampling_params()``) plus request fields."""
        if isinstance(params, cls) and not request:
            return params
        fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(EngineSamplingParams)}
        if isinstance(params, cls):
            fields.update({f: getattr(params, f) for f in REQUEST_FIELDS})
        return cls(**{**fields, **request})

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample ``index``: sample 0 keeps ``seed``, so ``n=1`` and ``n>1`` start alike."""
        if self.seed is None or index == 0:
            return self.seed
        return random.Random(f"{self.seed}:{index}").getrandbits(62)


REQUEST_FIELDS = ("max_tokens", "stop", "stop_token_ids", "n", "ignore_eos")
