"""Where the HTTP layer's fixed cost goes: timestamps along one streamed chat completion, stage by stage.

Starts the server in-process (as ``perf/bench_server.py`` does: uvicorn on loopback, the engine on
its own thread) and sends ``--requests`` streaming ``/v1/chat/completions`` one after another from a
client process (httpx, as the benchmark's load generator). Probes wrap the server's functions from
outside (nothing in ``ninfer`` is changed) and stamp ``time.perf_counter_ns()``; the client stamps
the same clock (CLOCK_MONOTONIC on Linux, shared between processes). Per stage the median over the
requests is printed, in ms:

* the request path, from the client's send to the engine thread's ``Engine.add_request`` and the
  first step: HTTP parsing, routing, body read and JSON decode, validation, chat template,
  tokenizer, the thread hops around them, request building, the hand-over to the engine thread;
* the TTFT overhead: per request, the client's TTFT (send to the first content line) minus the
  engine's first step (its start to the first token appended), i.e. the request path plus the
  first token's path;
* the token path, from a token's ``Postprocessor.append`` (sampled and detokenized, as in the library) to
  the client: the rest of the step, the cross-thread delivery, the asyncio hops, protocol chunk and
  SSE framing, the socket write, the client's read and JSON parse. The first token and the decode
  tokens are reported separately.

The probes themselves cost a few microseconds each (one list append; the wrapped ``Run.events``
adds one async-generator layer per event).

    PYTHONPATH=. OMP_NUM_THREADS=1 python perf/trace_server.py                # tiny model, CPU
    PYTHONPATH=. OMP_NUM_THREADS=1 python perf/trace_server.py --requests 50 --prompt-tokens 512
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_server  # sets TRITON_INTERPRET on CPU before the kernels load

MARKS: list[tuple[str, int]] = []
_CONTENT = re.compile(rb'"content": ?"[^"]')  # a content delta (the role chunk's content is "")
ENABLED = [False]
LOOP: list[asyncio.AbstractEventLoop] = []  # the server's event loop (seen at the first request)


def mark(label: str) -> None:
    if ENABLED[0]:
        MARKS.append((label, time.perf_counter_ns()))


def _around(owner: Any, name: str, before: str | None, after: str | None) -> None:
    """Wrap ``owner.name`` (sync or async) with marks before and after the call."""
    fn = getattr(owner, name)
    if asyncio.iscoroutinefunction(fn):
        async def wrapped(*a: Any, **k: Any) -> Any:
            if before:
                mark(before)
            out = await fn(*a, **k)
            if after:
                mark(after)
            return out
    else:
        def wrapped(*a: Any, **k: Any) -> Any:  # type: ignore[misc]
            if before:
                mark(before)
            out = fn(*a, **k)
            if after:
                mark(after)
            return out
    setattr(owner, name, wrapped)


def install_probes() -> None:
    """Wrap the server's functions; must run before ``create_app`` (routes capture their handlers)."""
    from uvicorn.protocols.http import h11_impl

    try:  # uvicorn takes httptools when it is installed
        from uvicorn.protocols.http import httptools_impl
        _around(httptools_impl.HttpToolsProtocol, "data_received", "data_received", None)
    except ImportError:
        pass
    from ninfer import api
    from ninfer.api import openai_chat, service
    from ninfer.runtime import async_engine, engine, postprocess
    from ninfer.tokenizer import Tokenizer

    _around(h11_impl.H11Protocol, "data_received", "data_received", None)
    _around(openai_chat, "handle", "handler", None)
    _around(openai_chat, "read_json", None, "body_json")
    _around(openai_chat, "parse", None, "parsed")
    _around(service.Service, "prompt", None, "prompt_done")
    _around(service.Service, "render", "render_start", "render_end")
    _around(Tokenizer, "encode", "encode_start", "encode_end")
    _around(service.Service, "request_for", None, "request_built")
    _around(service.Service, "start", "start", "admitted")
    _around(engine.Engine, "step", "step_start", "step_end")
    _around(postprocess.Postprocessor, "append", None, "appended")

    handle = async_engine.AsyncEngine._handle

    def traced_handle(self: Any, kind: str, arg: Any) -> None:
        if kind == "add":
            mark("engine_add")
        handle(self, kind, arg)
        if kind == "add":
            mark("engine_added")
    async_engine.AsyncEngine._handle = traced_handle  # type: ignore[method-assign]

    put = async_engine.queue.Queue.put

    def traced_put(self: Any, item: Any, *a: Any, **k: Any) -> None:
        if isinstance(item, tuple) and item and item[0] == "add":
            mark("submit")
        put(self, item, *a, **k)
    async_engine.queue.Queue.put = traced_put  # type: ignore[method-assign]

    # Engine thread -> event loop: every hand-over is a call_soon_threadsafe made on the engine thread.
    call_soon_threadsafe = asyncio.BaseEventLoop.call_soon_threadsafe

    def traced_call(self: Any, callback: Any, *args: Any, **kw: Any) -> Any:
        if threading.current_thread().name != "ninfer-engine":
            return call_soon_threadsafe(self, callback, *args, **kw)
        mark("deliver")

        def on_loop(*a: Any) -> None:
            mark("loop_recv")
            callback(*a)
        return call_soon_threadsafe(self, on_loop, *args, **kw)
    asyncio.BaseEventLoop.call_soon_threadsafe = traced_call  # type: ignore[method-assign]

    events = service.Run.events

    async def traced_events(self: Any, http: Any = None) -> Any:
        async for event in events(self, http):
            mark("run_event")
            yield event
    service.Run.events = traced_events  # type: ignore[method-assign]

    create_app = api.create_app

    def traced_create_app(*a: Any, **k: Any) -> Any:
        app = create_app(*a, **k)

        async def asgi(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
                return await app(scope, receive, send)
            mark("asgi")
            LOOP[:] = [asyncio.get_running_loop()]

            async def traced_send(message: dict) -> None:
                kind = message["type"]
                body = message.get("body", b"")
                label = "send_start" if kind == "http.response.start" else (
                    "send_content" if _CONTENT.search(body) else
                    "send_other" if message.get("more_body") else "send_final")
                mark(label)
                await send(message)
                mark(label + "_end")
            await app(scope, receive, traced_send)
        asgi.state = app.state  # type: ignore[attr-defined]
        return asgi
    api.create_app = traced_create_app  # type: ignore[assignment]


# ------------------------------------------------------------------------------------------ client
async def _client(url: str, texts: list[str], max_tokens: int) -> list[list[tuple[str, int]]]:
    import httpx

    out = []
    marks: list[tuple[str, int]] = []

    async def on_request(request: Any) -> None:  # the request is built, its bytes go out next
        marks.append(("client_sent", time.perf_counter_ns()))
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), event_hooks={"request": [on_request]}) as client:
        for text in texts:
            body = {"model": "bench", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "enable_thinking": False}
            marks.append(("client_send", time.perf_counter_ns()))
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    got = time.perf_counter_ns()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                    if delta.get("content"):
                        marks += [("client_line", got), ("client_parsed", time.perf_counter_ns())]
            marks.append(("client_done", time.perf_counter_ns()))
            out.append(marks)
            marks = []
    return out


def _client_main(conn: Any) -> None:
    while (job := conn.recv()) is not None:
        conn.send(asyncio.run(_client(*job)))


# ------------------------------------------------------------------------------------------ analysis
REQUEST_PATH = [  # (label, from, to): first occurrences within one request
    ("client: httpx builds the request (JSON body)", "client_send", "client_sent"),
    ("client sent -> server reads (httpx send, TCP, loop wake)", "client_sent", "data_received"),
    ("server read -> ASGI app (uvicorn HTTP parse, task)", "data_received", "asgi"),
    ("ASGI -> handler (Starlette routing, _endpoint)", "asgi", "handler"),
    ("body read + json.loads", "handler", "body_json"),
    ("validation (openai_chat.parse)", "body_json", "parsed"),
    ("parsed -> render starts (before: to_thread hop)", "parsed", "render_start"),
    ("chat template (Service.render)", "render_start", "render_end"),
    ("gap render -> tokenizer", "render_end", "encode_start"),
    ("tokenizer (Tokenizer.encode)", "encode_start", "encode_end"),
    ("tokens -> prompt ready (media check; before: hop back)", "encode_end", "prompt_done"),
    ("request building (sampling, Request)", "prompt_done", "request_built"),
    ("OutputStream + Service.start checks", "request_built", "start"),
    ("Run(): generate() -> queue.put", "start", "submit"),
    ("engine thread wakes (queue.get)", "submit", "engine_add"),
    ("Engine.add_request", "engine_add", "engine_added"),
    ("added -> first step starts", "engine_added", "step_start"),
]
TOTAL_REQUEST = ("client send -> first engine step", "client_send", "step_start")


def _split(marks: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """The server's marks, one list per request (requests ran one at a time)."""
    out: list[list[tuple[str, int]]] = []
    pending: list[tuple[str, int]] = []  # marks between one response's end and the next ASGI call
    open_ = False
    for label, t in marks:
        if label == "asgi":
            out.append(pending + [(label, t)])
            pending, open_ = [], True
        elif open_:
            out[-1].append((label, t))
            open_ = label != "send_final_end"
        else:
            pending.append((label, t))
    return out


def _first(marks: list[tuple[str, int]], label: str, after: int = 0) -> int | None:
    return next((t for lab, t in marks if lab == label and t >= after), None)


def _token_paths(marks: list[tuple[str, int]], client: list[tuple[str, int]]) -> list[dict[str, float]]:
    """Per streamed content token: the stage durations (ms) from ``appended`` to the client's parse.

    Each stage's mark is the first of its label after the previous stage's (hand-overs that carry no
    token, such as an admission notice, fall out)."""
    chain = ["appended", "deliver", "loop_recv", "run_event", "send_content", "send_content_end"]
    seqs = {lab: [t for lb, t in marks if lb == lab] for lab in chain}
    seqs["client_line"] = [t for lab, t in client if lab == "client_line"]
    seqs["client_parsed"] = [t for lab, t in client if lab == "client_parsed"]
    labels = chain + ["client_line", "client_parsed"]
    after = {"client_line": "send_content"}  # the client may read the line before the server's send returns
    rows = []
    for start in seqs["appended"]:
        ts: dict[str, int] = {}
        t = start
        for lab in labels:
            t = ts[after[lab]] if lab in after else t
            nxt = next((x for x in seqs[lab] if x >= t), None)
            if nxt is None:
                break
            ts[lab] = t = nxt
        if len(ts) < len(labels):
            break
        spans = [("appended", "deliver"), ("deliver", "loop_recv"), ("loop_recv", "run_event"),
                 ("run_event", "send_content"), ("send_content", "send_content_end"),
                 ("send_content", "client_line"), ("client_line", "client_parsed"), ("appended", "client_parsed")]
        rows.append({name: (ts[b] - ts[a]) / 1e6 for name, (a, b) in zip(TOKEN_STAGES + ["total"], spans)})
    return rows


TOKEN_STAGES = ["rest of the step (appended -> deliver)", "cross-thread wake (call_soon_threadsafe)",
                "asyncio hops (queue -> Run.events)", "chunk + SSE framing (-> ASGI send)",
                "uvicorn send (transport.write, GIL back)", "ASGI send -> client has the line (overlaps)",
                "client json.loads"]


def analyse(server_marks: list[tuple[str, int]], client_marks: list[list[tuple[str, int]]]) -> dict[str, Any]:
    per_req = _split(server_marks)
    assert len(per_req) == len(client_marks), (len(per_req), len(client_marks))
    stages: dict[str, list[float]] = {}
    first_tok: dict[str, list[float]] = {}
    decode_tok: dict[str, list[float]] = {}
    ttft, engine_ttft, overhead, steps = [], [], [], []
    for marks, client in zip(per_req, client_marks):
        all_marks = client[:2] + marks
        for name, a, b in REQUEST_PATH + [TOTAL_REQUEST]:
            ta, tb = _first(all_marks, a), _first(all_marks, b)
            if ta is not None and tb is not None:
                stages.setdefault(name, []).append((tb - ta) / 1e6)
        rows = _token_paths(marks, client)
        for i, row in enumerate(rows):
            for k, v in row.items():
                (first_tok if i == 0 else decode_tok).setdefault(k, []).append(v)
        send, line = client[0][1], _first(client, "client_line")
        ttft.append((line - send) / 1e6)
        engine_ttft.append((_first(marks, "appended") - _first(marks, "step_start")) / 1e6)
        overhead.append(ttft[-1] - engine_ttft[-1])
        starts = [t for lab, t in marks if lab == "step_start"]
        ends = [t for lab, t in marks if lab == "step_end"]
        steps += [(b - a) / 1e6 for a, b in zip(starts[1:], ends[1:])]  # decode steps
    def med(d: dict[str, list[float]]) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in d.items()}
    return {"request_path": med(stages), "first_token": med(first_tok), "decode_token": med(decode_tok),
            "ttft_client_ms": statistics.median(ttft), "engine_first_token_ms": statistics.median(engine_ttft),
            "ttft_overhead_ms": statistics.median(overhead),
            "decode_step_ms": statistics.median(steps) if steps else float("nan"), "requests": len(per_req)}


def show(result: dict[str, Any]) -> None:
    print(f"\n{result['requests']} requests, medians in ms")
    print("request path (client send -> engine):")
    for name, v in result["request_path"].items():
        print(f"  {v:8.3f}  {name}")
    for key, title in (("first_token", "first token"), ("decode_token", "decode tokens")):
        print(f"token path, {title} (Postprocessor.append -> client parsed):")
        for name, v in result[key].items():
            print(f"  {v:8.3f}  {name}")
    print(f"client TTFT {result['ttft_client_ms']:.3f}; engine first step (start -> first token appended) "
          f"{result['engine_first_token_ms']:.3f}; decode step {result['decode_step_ms']:.3f}")
    print(f"TTFT minus the engine's first step, per request: {result['ttft_overhead_ms']:.3f} "
          f"(what the HTTP path adds, the client's send and parse included)")


def _on_loop(fn: Any) -> Any:
    """Run ``fn`` on the server's event-loop thread (cProfile profiles the thread that enables it)."""
    done = threading.Event()
    owner = getattr(fn, "__self__", None)
    LOOP[0].call_soon_threadsafe(lambda: (fn(), done.set()))
    done.wait(10)
    return owner


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", help="also write the medians to this file")
    p.add_argument("--simulate-device", action="store_true", help="perf/device_sim.py's stand-in for a GPU")
    p.add_argument("--no-overlap", action="store_true", help="hand-overs as soon as a step ends (no launch timing)")
    p.add_argument("--profile", help="cProfile the event-loop thread over the measured requests; pstats to this file")
    p.add_argument("--switch-interval", type=float, default=bench_server.SERVE_SWITCH_MS, metavar="MS",
                   help="Python's thread switch interval (default: ninfer serve's)")
    args = p.parse_args(argv)
    bench_args = argparse.Namespace(random=None, model=None, device="cpu", lanes=2, prefill_chunk=1024,
                                    prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                                    no_cuda_graphs=True, respect_eos=False, text_tokens=True, recipe=None,
                                    simulate_device=args.simulate_device, no_overlap=args.no_overlap,
                                    switch_interval=args.switch_interval)
    llm, label = bench_server.load(bench_args)
    texts = [t for t, _ in bench_server.make_prompts(llm, args.requests + args.warmup, args.prompt_tokens)]
    install_probes()

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
    proc.start()
    with bench_server.InProcessServer(llm, max_pending=8, max_tokens=args.max_tokens) as server:
        conn.send((server.url, texts[:args.warmup], args.max_tokens))
        conn.recv()
        profiler = _on_loop(cProfile.Profile().enable) if args.profile else None
        ENABLED[0] = True
        conn.send((server.url, texts[args.warmup:], args.max_tokens))
        client_marks = conn.recv()
        ENABLED[0] = False
        if profiler is not None:
            _on_loop(profiler.disable)
            profiler.dump_stats(args.profile)
    conn.send(None)
    proc.join(timeout=30)
    result = analyse(MARKS, client_marks)
    print(f"{label}: prompt {args.prompt_tokens} tokens, max_tokens {args.max_tokens}, concurrency 1")
    show(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
