"""Prefix-cache benchmark at the 27B shape (random weights): what reuse saves on time to first token.

Measures in one run:
  - TTFT of a long conversation (``--context`` tokens, default 64k) continued by a 100-token user
    turn: cache off, cache with the checkpoint on the device, and with it moved to host memory;
  - an agent loop: ``--turns`` turns, each resending the whole history plus ~``--growth`` new tokens,
    prefill tokens computed and total time with the cache on and off, and the hit rate;
  - the checkpoint size per sequence and the host offload / restore bandwidth.

    python perf/bench_prefix_cache.py [--context 65536] [--turns 20] [--growth 5000]
"""
from __future__ import annotations

import argparse
import time

import torch

from common import copy_bandwidth_tbps, record
from random_model import random_llm
from ninfer.runtime.engine import EngineConfig
from ninfer.runtime.memory import state_bytes_per_slot
from ninfer.runtime.sampling import SamplingParams

GREEDY = SamplingParams(greedy=True)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of one request, and the prompt tokens it took from the cache."""
    req = llm._request(prompt, 1, GREEDY)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.engine.add_request(req)
    llm.engine.run_until_done()
    torch.cuda.synchronize()
    return time.perf_counter() - start, req.cached_tokens


def _engine(max_context: int, prefix: bool, host_gib: float = 0.0) -> EngineConfig:
    return EngineConfig(max_concurrency=1, max_context=max_context, kv_capacity=2 * max_context,
                        prefill_chunk=4096, cuda_graphs=False, prefix_cache=prefix, checkpoint_slots=2,
                        checkpoint_interval=8192, host_cache_bytes=int(host_gib * (1 << 30)))


def conversation(llm, context: int) -> None:
    history, turn = _tokens(context, 1), _tokens(100, 2)
    _ttft(llm, _tokens(min(2048, context), 9))  # warm up kernels and autotuning
    off_s, _ = _ttft(llm, history + turn) if llm.engine.prefix is None else (None, 0)
    if llm.engine.prefix is None:
        record("prefix_ttft", f"27b ctx={context}+100 cache=off", off_s * 1e3, achieved=context / off_s,
               limit=float("nan"), unit="tok/s")
        return
    _ttft(llm, history)  # leaves a checkpoint at context - 1 (and at every 8k)
    on_s, cached = _ttft(llm, history + turn)
    record("prefix_ttft", f"27b ctx={context}+100 cache=device", on_s * 1e3, achieved=cached / on_s,
           limit=float("nan"), unit="tok/s", cached_tokens=cached)
    if llm.engine.prefix.host_bytes_limit:
        llm.engine.prefix.clear()
        _ttft(llm, history)
        while llm.engine.prefix.evict_one():  # push every checkpoint to host memory
            pass
        host_s, cached = _ttft(llm, history + turn)
        record("prefix_ttft", f"27b ctx={context}+100 cache=host", host_s * 1e3, achieved=cached / host_s,
               limit=float("nan"), unit="tok/s", cached_tokens=cached)


def agent_loop(llm, turns: int, growth: int) -> None:
    history, computed, start = [], 0, time.perf_counter()
    hits = 0
    for t in range(turns):
        history = history + _tokens(growth, 100 + t)
        _, cached = _ttft(llm, history)
        computed += len(history) - cached
        hits += cached > 0
    seconds = time.perf_counter() - start
    mode = "on" if llm.engine.prefix is not None else "off"
    record("prefix_agent_loop", f"27b {turns} turns to {len(history)} tok cache={mode}", seconds * 1e3,
           achieved=computed, limit=float("nan"), unit="prefill tokens", hit_rate=round(hits / turns, 3))


def offload_bandwidth(llm) -> None:
    cache, slot_bytes = llm.engine.cache, state_bytes_per_slot(llm.config, llm.model.dtype)
    torch.cuda.synchronize()
    start = time.perf_counter()
    saved = cache.save_slot(0)
    torch.cuda.synchronize()
    down = time.perf_counter() - start
    start = time.perf_counter()
    cache.restore_slot(0, saved)
    torch.cuda.synchronize()
    up = time.perf_counter() - start
    bw = copy_bandwidth_tbps()
    record("prefix_offload", f"27b state slot {slot_bytes / 2**20:.0f} MiB device->host", down * 1e3,
           achieved=slot_bytes / down / 1e12, limit=bw, unit="TB/s")
    record("prefix_restore", f"27b state slot {slot_bytes / 2**20:.0f} MiB host->device", up * 1e3,
           achieved=slot_bytes / up / 1e12, limit=bw, unit="TB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--growth", type=int, default=5000)
    args = parser.parse_args()
    longest = max(args.context + 200, args.turns * args.growth + 64)
    for prefix, host in ((False, 0.0), (True, 8.0)):
        llm = random_llm("27b", _engine(longest, prefix, host))
        llm.stop_ids = frozenset()
        conversation(llm, args.context)
        agent_loop(llm, args.turns, args.growth)
        if prefix:
            offload_bandwidth(llm)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
