"""A CPU stand-in for an asynchronous accelerator, to measure on a laptop what the HTTP layer costs a GPU engine.

On a GPU the engine thread launches a step's kernels (Python, holding the GIL but for the short
moments each op releases it), the device runs them in launch order, and the host then waits for the
tokens with the GIL released. Whatever the server's event-loop thread does while the engine thread
launches delays the launches, and the device idles once its queue has drained; what it does while
the engine thread waits costs nothing. The CPU engine has no such split (its forward computes in
place), so :func:`simulate_device` replaces the model of a loaded ``LLM`` with one that has it:

* a forward is ``chunks`` launch pieces; each spends ``launch_ms / chunks`` alternating 10 us of Python
  (GIL held) and a small torch op (GIL released, as every op's binding does), then queues ``device_ms / chunks`` of device time
  (the device starts a piece when it is queued and the previous one is done);
* the host's reads of sampled tokens (the sampler's sync, a decode step in flight landing) sleep (GIL released) until
  the device has run what was queued before them;
* logits are random over the plain-text tokens only, so every token is one streamed text delta.

Prefill (a forward over more than one token per sequence) and decode (one token per sequence, a CUDA
graph: one launch piece) take their own times. The engine's own Python (scheduling, tensors,
sampling, detokenizing) runs for real on top.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ninfer.runtime.run_ahead import InFlight

_SLICE_S = 10e-6  # Python between two ops while launching
_OP_ELEMS = 1 << 15  # an op of several microseconds with the GIL released (a launch, a pageable H2D copy)


@dataclass
class DeviceTimes:
    prefill_launch_ms: float = 20.0
    prefill_device_ms: float = 80.0
    prefill_chunks: int = 64  # layers: the device runs a layer once it is launched
    decode_launch_ms: float = 0.2
    decode_device_ms: float = 11.0


class _Device:
    def __init__(self) -> None:
        self.free_at = 0.0  # perf_counter time at which the queued work is done
        self.a, self.b = torch.ones(_OP_ELEMS), torch.empty(_OP_ELEMS)

    def launch(self, launch_s: float, device_s: float, chunks: int) -> None:
        for _ in range(chunks):
            end = time.perf_counter() + launch_s / chunks
            while time.perf_counter() < end:
                stop = min(end, time.perf_counter() + _SLICE_S)
                while time.perf_counter() < stop:  # holds the GIL, as the Python around each op does
                    pass
                torch.add(self.a, 1, out=self.b)  # an op: the binding releases the GIL for its few microseconds
            self.free_at = max(self.free_at, time.perf_counter()) + device_s / chunks

    def sync(self) -> None:
        wait = self.free_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


class _Landed:
    """The CUDA event behind a step's draw: complete once the device has run everything queued before it."""

    def __init__(self, device: _Device) -> None:
        self.at = device.free_at

    def synchronize(self) -> None:
        wait = self.at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


class _SimulatedModel:
    """Enough of ``Qwen3_5TextModel`` for the engine's step: ``model(batch, cache)`` and ``model.logits``."""

    def __init__(self, device: _Device, times: DeviceTimes, allowed: torch.Tensor, vocab: int) -> None:
        self.device_sim, self.times = device, times
        self.mask = torch.full((vocab,), float("-inf"))
        self.mask[allowed] = 0.0
        self.gen = torch.Generator().manual_seed(0)

    def __call__(self, batch: Any, cache: Any, inputs_embeds: Any = None) -> torch.Tensor:
        n, seqs = int(batch.input_ids.shape[0]), int(batch.cu_seqlens.shape[0]) - 1
        t = self.times
        if n > seqs:
            self.device_sim.launch(t.prefill_launch_ms / 1e3, t.prefill_device_ms / 1e3, t.prefill_chunks)
        else:
            self.device_sim.launch(t.decode_launch_ms / 1e3, t.decode_device_ms / 1e3, 1)
        return torch.zeros(n, 1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.randn(hidden.shape[0], self.mask.shape[0], generator=self.gen) + self.mask


def simulate_device(llm: Any, times: DeviceTimes, overlap: bool = True) -> None:
    """Give ``llm.engine`` a simulated asynchronous device; ``overlap``: let the server time its hand-overs to
    the device's waits (``Engine.launches_async``, as on CUDA)."""
    engine = llm.engine
    tok = llm.tokenizer
    vocab = engine.sampler.counts.shape[1]
    allowed = [i for i in range(min(llm.valid_vocab, vocab))
               if (s := tok.decode([i])) and s.isascii() and s.isprintable() and not any(c in s for c in "<>&")]
    device = _Device()
    engine.runner.model = _SimulatedModel(device, times, torch.tensor(allowed), vocab)
    engine.launches_async = overlap
    sample = engine.sampler.sample

    def synced_sample(logits: torch.Tensor, reqs: list) -> Any:
        device.sync()  # the real sampler's tolist() waits for the device here
        return sample(logits, reqs)
    engine.sampler.sample = synced_sample

    def launch_in_flight(cls: type[InFlight], reqs: list, draw: Any) -> InFlight:
        # A decode step left in flight (ninfer/runtime/run_ahead.py) reads its tokens when it lands: on CUDA after
        # an event recorded behind the draw; here after the device has run what was queued by then.
        return cls(reqs, draw, draw.out.token_ids, _Landed(device))
    InFlight.launch = classmethod(launch_in_flight)  # type: ignore[method-assign,assignment]
