"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Counters and histograms are updated by the request path; the engine gauges (lanes, queue, KV
pages, state slots) are read at scrape time from a snapshot taken on the engine thread.
"""
from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                  0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


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


# Engine totals (monotonic since the engine started): exported as counters, read from the snapshot.
_TOTALS = {"prefix_hits": ("ninfer_prefix_cache_hits", "Requests that resumed from a cached prefix"),
           "prefix_hit_tokens": ("ninfer_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache"),
           "prefix_evictions": ("ninfer_prefix_cache_evictions", "Prefix checkpoints evicted"),
           "prefix_offloads": ("ninfer_prefix_cache_host_offloads", "Prefix checkpoints moved to host memory"),
           "prefix_restores": ("ninfer_prefix_cache_host_restores",
                               "Prefix checkpoints copied back from host memory"),
           "spec_rounds": ("ninfer_spec_decode_rounds", "Speculative draft + verify rounds of finished requests"),
           "spec_drafted": ("ninfer_spec_decode_draft_tokens", "Tokens drafted by the MTP head"),
           "spec_accepted": ("ninfer_spec_decode_accepted_tokens", "Drafted tokens the target accepted"),
           "pauses": ("ninfer_requests_paused", "Requests paused to free KV pages"),
           "resumes": ("ninfer_requests_resumed", "Paused requests resumed")}
# Engine state (a level now): gauges.
_GAUGES = {"running": ("ninfer_requests_running", "Requests in a lane"),
           "waiting": ("ninfer_requests_waiting", "Requests in the engine's wait queue"),
           "kv_used": ("ninfer_device_kv_used_pages", "KV pages in use"),
           "kv_capacity": ("ninfer_device_kv_capacity_pages", "KV pages in the pool"),
           "slots_used": ("ninfer_device_state_used_slots", "DeltaNet state slots in use"),
           "slots_capacity": ("ninfer_device_state_capacity_slots", "DeltaNet state slots"),
           "prefix_checkpoints": ("ninfer_prefix_cache_checkpoints", "Prefix checkpoints held now"),
           "prefix_host_bytes": ("ninfer_prefix_cache_host_bytes", "Host memory held by prefix checkpoints"),
           "pause_host_bytes": ("ninfer_paused_host_bytes", "Host memory held by snapshots of paused requests")}


class _EngineTotals:
    """A collector exporting the last snapshot's engine totals as counters (``_total``)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, int] = {}

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        for key, (name, helps) in _TOTALS.items():
            family = CounterMetricFamily(name, helps + " (engine total)")
            family.add_metric([], self.snapshot.get(key, 0))
            yield family


class Metrics:
    """The request-path series carry a ``model_name`` label (vLLM's convention); the engine's state and
    totals are of the one engine, without it."""

    def __init__(self, model_id: str, max_concurrency: int, max_context: int) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_id
        Info("ninfer_model", "The served model", registry=r).info({"model": model_id})
        Gauge("ninfer_max_concurrency", "Resident lanes", registry=r).set(max_concurrency)
        Gauge("ninfer_max_context_tokens", "Per-sequence token ceiling", registry=r).set(max_context)
        self.ready = Gauge("ninfer_engine_ready", "1 while the engine thread runs", registry=r)
        label = ["model_name"]

        def counter(name: str, helps: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(name, helps, [*label, *extra], registry=r)

        def histogram(name: str, helps: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Any:
            return Histogram(name, helps, label, buckets=buckets, registry=r).labels(model_id)
        self.requests = counter("ninfer_requests", "Finished or rejected requests by outcome", ("outcome",))
        self.prompt_tokens = counter("ninfer_prompt_tokens", "Prompt tokens of admitted requests").labels(model_id)
        self.prompt_tokens_cached = counter("ninfer_prompt_tokens_cached",
                                            "Prompt tokens read from a cache").labels(model_id)
        self.prefill_tokens = counter("ninfer_prefill_tokens", "Prompt tokens computed (prompt minus cached) of "
                                                               "admitted requests").labels(model_id)
        self.generation_tokens = counter("ninfer_generation_tokens", "Generated (decode) tokens").labels(model_id)
        self.ttft = histogram("ninfer_time_to_first_token_seconds", "Arrival to first generated token")
        self.tpot = histogram("ninfer_time_per_output_token_seconds", "Mean time per generated token after the "
                                                                      "first, per request", _TOKEN_BUCKETS)
        self.itl = histogram("ninfer_inter_token_latency_seconds", "Time between two token deliveries, per token",
                             _TOKEN_BUCKETS)
        self.duration = histogram("ninfer_request_duration_seconds", "Arrival to finish")
        self.queue_time = histogram("ninfer_request_queue_seconds", "Arrival to admission into a lane")
        self.http_responses = counter("ninfer_http_responses", "HTTP responses by route template and status "
                                      "(errors included: 4xx validation, auth, overload; 5xx)", ("route", "status"))
        self.http_pending = Gauge("ninfer_http_requests_in_flight", "Generation requests the server holds",
                                  registry=r)
        self.engine_gauges = {k: Gauge(n, h, registry=r) for k, (n, h) in _GAUGES.items()}
        self.totals = _EngineTotals()
        r.register(self.totals)  # type: ignore[arg-type]

    def responded(self, route: str, status: int) -> None:
        """Count one HTTP response; ``route`` is the route's template (bounded label values)."""
        self.http_responses.labels(self.model_name, route, str(status)).inc()

    def rejected(self, outcome: str) -> None:
        self.requests.labels(self.model_name, outcome).inc()

    def admitted(self, prompt_tokens: int, cached_tokens: int, queue_s: float) -> None:
        self.queue_time.observe(max(0.0, queue_s))
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_tokens_cached.inc(cached_tokens)
        self.prefill_tokens.inc(max(0, prompt_tokens - cached_tokens))

    def finished(self, outcome: str, generated: int, ttft_s: float | None, duration_s: float) -> None:
        self.requests.labels(self.model_name, outcome).inc()
        self.generation_tokens.inc(generated)
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))
            if generated > 1:
                self.tpot.observe(max(0.0, duration_s - ttft_s) / (generated - 1))
        self.duration.observe(max(0.0, duration_s))

    async def render(self, engine: Any, alive: bool, in_flight: int) -> bytes:
        """Prometheus text format 0.0.4, with a fresh engine snapshot (taken between engine steps)."""
        self.ready.set(1 if alive else 0)
        self.http_pending.set(in_flight)
        snap = await _snapshot(engine) if alive else None
        if snap is not None:
            for key, gauge in self.engine_gauges.items():
                gauge.set(snap[key])
            self.totals.snapshot = snap
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
