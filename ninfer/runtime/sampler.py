"""Per-lane sampling state and the call that turns a batch of logits into tokens."""
from __future__ import annotations

import torch

from ninfer.runtime.request import Request
from ninfer.runtime.sampling import make_generator, sample_reference


class Sampler:
    def __init__(self, max_lanes: int, vocab_size: int, vocab_limit: int, device: torch.device) -> None:
        self.vocab_limit = vocab_limit
        self.device = device
        self._generators: dict[str, torch.Generator | None] = {}

    def start(self, req: Request) -> None:
        self._generators[req.request_id] = make_generator(req.params, torch.device("cpu"))

    def finish(self, req: Request) -> None:
        self._generators.pop(req.request_id, None)

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        rows = logits[:, : self.vocab_limit].float().cpu()
        return [sample_reference(rows[i], r.params, self._generators[r.request_id]) for i, r in enumerate(reqs)]
