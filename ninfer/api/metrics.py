"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Counters and histograms are updated by the request path; the engine gauges (lanes, queue, KV
pages, state slots) are read at scrape time from a snapshot taken on the engine thread.
"""
from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


def engine_snapshot(engine: Any) -> dict[str, int]:
    """Occupancy of the engine's lanes, queue, pages and slots (run on the engine thread)."""
    s, pages, slots = engine.scheduler, engine.pages, engine.slots
    return {"running": len(s.running), "waiting": len(s.waiting),
            "kv_used": pages.num_pages - pages.num_free, "kv_capacity": pages.num_pages,
            "slots_used": slots.num_slots - slots.num_free, "slots_capacity": slots.num_slots,
            **_prefix_snapshot(engine.prefix), **_spec_snapshot(engine),
            **_pause_snapshot(getattr(engine, "pauser", None))}


def _spec_snapshot(engine: Any) -> dict[str, int]:
    """Speculative-decoding totals of finished requests (zeros when speculation is off)."""
    st = getattr(engine, "spec_totals", None)
    return {"spec_rounds": st.rounds if st else 0, "spec_drafted": st.drafted if st else 0,
            "spec_accepted": st.accepted if st else 0}


def _prefix_snapshot(prefix: Any) -> dict[str, int]:
    """Prefix-cache counters (zeros when the cache is off)."""
    if prefix is None:
        return dict.fromkeys(("prefix_hits", "prefix_hit_tokens", "prefix_evictions", "prefix_checkpoints",
                              "prefix_offloads", "prefix_restores", "prefix_host_bytes"), 0)
    st = prefix.stats
    return {"prefix_hits": st.hits, "prefix_hit_tokens": st.hit_tokens, "prefix_evictions": st.evicted,
            "prefix_checkpoints": len(prefix), "prefix_offloads": st.offloaded, "prefix_restores": st.restored,
            "prefix_host_bytes": prefix.host_bytes}


def _pause_snapshot(pauser: Any) -> dict[str, int]:
    """Requests paused under memory pressure and resumed (totals), and the host memory of their snapshots."""
    if pauser is None:
        return dict.fromkeys(("pauses", "resumes", "pause_host_bytes"), 0)
    return {"pauses": pauser.stats.pauses, "resumes": pauser.stats.resumes, "pause_host_bytes": pauser.host_bytes}


class Metrics:
    def __init__(self, model_id: str, max_concurrency: int, max_context: int) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        Info("ninfer_model", "The served model", registry=r).info({"model": model_id})
        Gauge("ninfer_max_concurrency", "Resident lanes", registry=r).set(max_concurrency)
        Gauge("ninfer_max_context_tokens", "Per-sequence token ceiling", registry=r).set(max_context)
        self.ready = Gauge("ninfer_engine_ready", "1 while the engine thread runs", registry=r)
        self.requests = Counter("ninfer_requests", "Finished or rejected requests by outcome", ["outcome"],
                                registry=r)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.prompt_tokens_cached = Counter("ninfer_prompt_tokens_cached", "Prompt tokens read from a cache",
                                            registry=r)
        self.generation_tokens = Counter("ninfer_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("ninfer_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("ninfer_request_duration_seconds", "Arrival to finish",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("ninfer_request_queue_seconds", "Arrival to admission into a lane",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.http_responses = Counter("ninfer_http_responses", "HTTP responses by route template and status "
                                      "(errors included: 4xx validation, auth, overload; 5xx)",
                                      ["route", "status"], registry=r)
        self.http_pending = Gauge("ninfer_http_requests_in_flight", "Generation requests the server holds",
                                  registry=r)
        names = {"running": "ninfer_requests_running", "waiting": "ninfer_requests_waiting",
                 "kv_used": "ninfer_device_kv_used_pages", "kv_capacity": "ninfer_device_kv_capacity_pages",
                 "slots_used": "ninfer_device_state_used_slots",
                 "slots_capacity": "ninfer_device_state_capacity_slots",
                 "prefix_hits": "ninfer_prefix_cache_hits", "prefix_hit_tokens": "ninfer_prefix_cache_hit_tokens",
                 "prefix_evictions": "ninfer_prefix_cache_evictions",
                 "prefix_checkpoints": "ninfer_prefix_cache_checkpoints",
                 "prefix_offloads": "ninfer_prefix_cache_host_offloads",
                 "prefix_restores": "ninfer_prefix_cache_host_restores",
                 "prefix_host_bytes": "ninfer_prefix_cache_host_bytes",
                 "spec_rounds": "ninfer_spec_decode_rounds", "spec_drafted": "ninfer_spec_decode_draft_tokens",
                 "spec_accepted": "ninfer_spec_decode_accepted_tokens",
                 "pauses": "ninfer_requests_paused", "resumes": "ninfer_requests_resumed",
                 "pause_host_bytes": "ninfer_paused_host_bytes"}
        helps = {"running": "Requests in a lane", "waiting": "Requests in the engine's wait queue",
                 "kv_used": "KV pages in use", "kv_capacity": "KV pages in the pool",
                 "slots_used": "DeltaNet state slots in use", "slots_capacity": "DeltaNet state slots",
                 "prefix_hits": "Requests that resumed from a cached prefix (total)",
                 "prefix_hit_tokens": "Prompt tokens taken from the prefix cache (total)",
                 "prefix_evictions": "Prefix checkpoints evicted (total)",
                 "prefix_checkpoints": "Prefix checkpoints held now",
                 "prefix_offloads": "Prefix checkpoints moved to host memory (total)",
                 "prefix_restores": "Prefix checkpoints copied back from host memory (total)",
                 "prefix_host_bytes": "Host memory held by prefix checkpoints",
                 "spec_rounds": "Speculative draft + verify rounds of finished requests (total)",
                 "spec_drafted": "Tokens drafted by the MTP head (total)",
                 "spec_accepted": "Drafted tokens the target accepted (total)",
                 "pauses": "Requests paused to free KV pages (total)",
                 "resumes": "Paused requests resumed (total)",
                 "pause_host_bytes": "Host memory held by snapshots of paused requests"}
        self.engine_gauges = {k: Gauge(n, helps[k], registry=r) for k, n in names.items()}

    def responded(self, route: str, status: int) -> None:
        """Count one HTTP response; ``route`` is the route's template (bounded label values)."""
        self.http_responses.labels(route=route, status=str(status)).inc()

    def rejected(self, outcome: str) -> None:
        self.requests.labels(outcome=outcome).inc()

    def finished(self, outcome: str, generated: int, ttft_s: float | None, duration_s: float) -> None:
        self.requests.labels(outcome=outcome).inc()
        self.generation_tokens.inc(generated)
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))
        self.duration.observe(max(0.0, duration_s))

    async def render(self, engine: Any, alive: bool, in_flight: int) -> bytes:
        """Prometheus text format 0.0.4, with a fresh engine snapshot (taken between engine steps)."""
        self.ready.set(1 if alive else 0)
        self.http_pending.set(in_flight)
        snap = await _snapshot(engine) if alive else None
        for key, gauge in self.engine_gauges.items():
            if snap is not None:
                gauge.set(snap[key])
        return generate_latest(self.registry)


async def _snapshot(async_engine: Any, timeout_s: float = 2.0) -> dict[str, int] | None:
    """Ask the engine thread for a snapshot; fall back to reading directly if it is busy too long."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def take(engine: Any) -> None:
        try:
            snap: Any = engine_snapshot(engine)
        except AttributeError as err:  # an engine without these pools (a stub): no engine gauges
            snap = err
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(snap))

    async_engine.call(take)
    try:
        snap = await asyncio.wait_for(future, timeout_s)
    except TimeoutError:
        try:
            snap = engine_snapshot(async_engine.engine)
        except AttributeError:
            return None
    return None if isinstance(snap, Exception) else snap
