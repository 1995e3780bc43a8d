"""Decode steps left in flight: the host's work of one step runs while the GPU computes the next.

A plain decode step is serial: the host prepares the inputs, launches the step (a CUDA graph's replay and the
sampling kernel), waits for the tokens, turns them into text, checks stops and plans the next step, and the GPU
idles through everything after the wait. Instead, a step whose batch may go on is left :class:`InFlight`: the
next engine step launches its successor with the drawn tokens, still on the device, as inputs, and only then
reads them (vLLM's async scheduling, SGLang's overlap scheduler).

Running one step ahead changes three things, each safe:

- A request that stops on the token read last was already fed that token by the step in flight. The row is
  dropped when it lands; the request's state and KV then cover ``tokens(0, num_computed)`` exactly, which is what
  the prefix cache keeps at its end.
- Its pages, slot and lane go back to the pools while that step still runs; whatever reuses them is queued on
  the same stream, after it.
- What needs every token on the host first lands the step in flight before it runs: admitting, prefilling and
  pausing (the engine checks before its step), speculation (never run ahead). A batch is not left in flight
  while one of its requests is constrained by a grammar, asks for logprobs, or has stop ids or a thinking budget
  still forced: the sampler reads those requests' output length on the host before each draw.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer.runtime.request import Request, RequestOutput, Status
from ninfer.runtime.sampler import Draw, Sampler, TokenLogprobs

Append = Callable[[Request, int, TokenLogprobs | None], list[RequestOutput]]


def may_run_ahead(reqs: list[Request]) -> bool:
    """Whether the next draw of ``reqs`` is right without their latest tokens on the host (module docstring), and
    some request will take part in it: one whose token in flight is its last by length does not."""
    return any(len(r.output_ids) + 1 < r.max_new_tokens for r in reqs) and all(r.grammar is None and r.params.logprobs is None
               and not (r.min_tokens_ids and r.params.min_tokens > len(r.output_ids))
               and (r.think_end is None or r.params.thinking_budget is None) for r in reqs)


@dataclass
class InFlight:
    """A launched decode step's draw: its tokens on the device, and their copy to the host once ``landed``."""

    reqs: list[Request]
    draw: Draw
    host: torch.Tensor
    landed: torch.cuda.Event | None

    @classmethod
    def launch(cls, reqs: list[Request], draw: Draw) -> InFlight:
        """Queue the tokens' copy to pinned host memory behind the draw (on a CPU they are already there)."""
        tokens = draw.out.token_ids
        if tokens.device.type != "cuda":
            return cls(reqs, draw, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        return cls(reqs, draw, host, landed)

    def inputs_for(self, reqs: list[Request]) -> torch.Tensor:
        """The drawn tokens of ``reqs`` (each one of this step's requests) on the device: the next step's inputs."""
        tokens = self.draw.out.token_ids
        if len(reqs) == len(self.reqs) and all(a is b for a, b in zip(reqs, self.reqs)):
            return tokens
        row = {id(r): i for i, r in enumerate(self.reqs)}
        index = torch.tensor([row[id(r)] for r in reqs], dtype=torch.long, pin_memory=tokens.is_cuda)
        return tokens.index_select(0, index.to(tokens.device, non_blocking=True))

    def land(self, sampler: Sampler, append: Append, events: list[RequestOutput]) -> None:
        """Wait for the tokens and ``append`` each to its request, skipping requests that ended meanwhile."""
        if self.landed is not None:
            self.landed.synchronize()
        tokens = self.host.tolist()
        logprobs = ([lps[0] for lps in sampler.logprobs(self.draw, [[t] for t in tokens])]
                    if self.draw.want_logprobs else [None] * len(tokens))
        for req, token, lp in zip(self.reqs, tokens, logprobs):
            if req.status is Status.RUNNING:
                events.extend(append(req, token, lp))
