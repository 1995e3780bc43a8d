"""What ``LLM.generate`` / ``chat`` and the async API return.

:class:`Completion` is one sampled continuation (vLLM's ``CompletionOutput``, and ninfer's own result
since the start); :class:`RequestOutput` groups the ``n`` completions of one prompt the way vLLM does;
:class:`StreamOutput` is one delta of the async API.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the server's types, imported lazily where used: `import ninfer` does not load the server
    from ninfer.api.output import Usage
    from ninfer.api.tool_parser import ToolCall

# Engine logprobs of one token: (token_id, logprob, [(alt_id, alt_logprob), ...]), alternatives best first.
EngineLogprobs = tuple[int, float, list[tuple[int, float]]]


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability under the model's raw distribution (before temperature and filters);
    ``rank`` is its 1-based place among the alternatives asked for, None when it is not among them."""

    logprob: float
    rank: int | None
    decoded_token: str


# Per generated token: {token_id: Logprob} for the sampled token and its top alternatives (vLLM's shape).
TokenLogprobs = dict[int, Logprob]


@dataclass
class Completion:
    """One generated continuation (``text`` is the answer; ``reasoning`` the thinking of a chat reply)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence, stop token or string), "length", "cancelled" or "error"
    prompt_tokens: int
    reasoning: str | None = None
    ttft_s: float = 0.0
    decode_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    speculation: dict[str, Any] | None = None  # with spec="mtp": rounds, drafted, accepted, acceptance
    index: int = 0  # which of the prompt's n samples
    logprobs: list[TokenLogprobs] | None = None  # with SamplingParams.logprobs set
    tool_calls: list[ToolCall] = field(default_factory=list)  # parsed from the answer of a chat with tools
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (None: EOS or length)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.token_ids) - 1
        return steps / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the sampled tokens' logprobs (None without ``logprobs``)."""
        if self.logprobs is None:
            return None
        return sum(entry[t].logprob for entry, t in zip(self.logprobs, self.token_ids))


CompletionOutput = Completion  # vLLM's name


@dataclass
class RequestOutput:
    """All completions of one prompt (vLLM's ``RequestOutput``): ``outputs[i]`` is sample ``i``."""

    request_id: str
    prompt: str | None  # the prompt text (a chat's rendered prompt); None for token-id prompts
    prompt_token_ids: list[int]
    outputs: list[Completion]
    finished: bool = True

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens reused from the prefix cache, over all samples."""
        return sum(c.cached_tokens for c in self.outputs)


@dataclass
class StreamOutput:
    """One delta of a streamed generation: what sample ``index`` added since its previous delta.

    ``text`` is answer text, ``reasoning`` thinking text (chats), ``tool_calls`` the calls completed in
    this delta (chats with tools). A sample's last delta has ``finished``, its ``finish_reason`` and
    ``stop_reason``, and ``usage``; ``error`` says why when the engine failed it.
    """

    request_id: str
    index: int = 0
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    error: str | None = None


def convert_logprobs(entries: list[EngineLogprobs], decode: Any) -> list[TokenLogprobs]:
    """Engine logprob entries to vLLM's per-token dicts; ``decode(token_id)`` gives a token's text."""
    out: list[TokenLogprobs] = []
    for token_id, logprob, alternatives in entries:
        ranks = {alt: i + 1 for i, (alt, _) in enumerate(alternatives)}
        entry = {alt: Logprob(lp, i + 1, decode(alt)) for i, (alt, lp) in enumerate(alternatives)}
        entry[token_id] = Logprob(logprob, ranks.get(token_id), decode(token_id))
        out.append(entry)
    return out


__all__ = ["Completion", "CompletionOutput", "Logprob", "RequestOutput", "StreamOutput", "TokenLogprobs",
           "convert_logprobs"]
