"""A generation request and the events it produces."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from ninfer.runtime.sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"  # admitted once, then sent back to the wait queue to free memory (see pause.py)
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """One event of a request's stream: new tokens and text, and on the last event the finish reason."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    reasoning: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled", or "error"
    error: str | None = None
    # With SamplingParams.logprobs set: per token, (token_id, logprob, [(alt_id, alt_logprob), ...]).
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


@dataclass
class Request:
    """Everything the engine needs to run one sequence, plus where its state lives while it runs."""

    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    thinking: bool | None = None  # None: raw text; True/False: a chat reply (reasoning split applies)
    mm: Any = None  # multimodal prompt inputs (ninfer.vision.MultimodalInputs): positions and media embeddings
    rope_delta: int = 0  # M-RoPE position offset of tokens after the prompt (non-zero after media)
    checkpoint_marks: tuple[int, ...] = ()  # prompt positions where the prefix cache should checkpoint
    # (first token index, content hash) of each media item: the prefix cache keys media by content,
    # since all pad tokens share one id whatever the image.
    media_keys: tuple[tuple[int, str], ...] = ()
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")

    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV and DeltaNet state are in the cache
    pages: list[int] = field(default_factory=list)
    reserved_pages: int = 0
    lane: int | None = None
    slot: int | None = None
    spare_slots: list[int] = field(default_factory=list)  # speculative decoding: per-token state slots
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    admit_time: float | None = None
    prefix_hit: Any = None  # the PrefixHit this request resumed from, until admission applies it
    paused: Any = None  # the PausedState (sampler lane, host snapshot) of a paused request, until it resumes
    replay_until: int = 0  # after a pause without snapshot: tokens [0, replay_until) of prompt + output prefill again
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed
    first_token_time: float | None = None
    finish_time: float | None = None
    spec_stats: Any = None  # a runtime.speculative.SpecStats when the engine speculates
    grammar: Any = None  # a runtime.structured.GrammarState: the answer's constraint, masked in the sampler
    # The ids that end this request (its output processor's stop ids), which the sampler masks while fewer
    # than params.min_tokens tokens are out; the engine sets them when the request is added.
    min_tokens_ids: frozenset[int] = frozenset()
    # With a thinking budget, while the reasoning is open: the ``</think>`` id the sampler forces once
    # params.thinking_budget tokens are out (the engine sets it on add; None once the reasoning closed).
    think_end: int | None = None

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_target(self) -> int:
        """Where prefilling stops: the prompt's end, or the end of the replayed tokens after a pause."""
        return max(len(self.prompt_ids), self.replay_until)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prefill_target

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt followed by output."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids[start:] if start < n else []) + self.output_ids[max(0, start - n):end - n]
