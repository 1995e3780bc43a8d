"""``ninfer serve MODEL``: load a checkpoint and serve it over HTTP.

``add_serve_parser(subparsers)`` adds the subcommand to a parser; ``run_serve(args)`` runs it.
``python -m ninfer.api.cli serve MODEL ...`` works on its own as well.
"""
from __future__ import annotations

import argparse
import logging
import sys

from ninfer.api.config import ServerConfig

SERVE_EXAMPLES = """examples:
  ninfer serve Qwen/Qwen3.6-27B --max-concurrency 4 --max-context 32768
  ninfer serve ./my-model --port 9000 --api-key secret --no-thinking
  curl http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'
"""


def _int(flag: str, lo: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {lo}, got {value}")
        return value
    return parse


def _float(flag: str, lo: float, hi: float | None = None, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects a number, got {text!r}") from None
        if (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{flag} is out of range: {value}")
        return value
    return parse


def _kv_capacity(text: str) -> int | str:
    return text if text == "auto" else _int("--kv-capacity")(text)


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ninfer.api.serve_ops import add_ops_options
    from ninfer.cli import add_spec_options  # the ninfer command imports this module while it builds

    p = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI and Anthropic APIs)",
                              description="Serve OpenAI Chat Completions / Responses and Anthropic Messages.",
                              epilog=SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="checkpoint directory or Hugging Face id (default: bundled tiny model)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=_int("--port", 0), default=8080, help="listen port (default 8080)")
    add_ops_options(p)
    p.add_argument("--model-id", metavar="ID", help="public model name (default: the checkpoint directory name)")
    p.add_argument("--max-concurrency", type=_int("--max-concurrency"), default=1, metavar="N",
                   help="sequences decoded together, 1..8 (default 1)")
    p.add_argument("--max-pending", "--max-pending-requests", dest="max_pending", type=_int("--max-pending", 0),
                   default=16, metavar="N", help="waiting requests beyond the lanes; more get 429 (default 16)")
    p.add_argument("--pending-timeout-ms", type=_int("--pending-timeout-ms"), default=30000, metavar="N",
                   help="admission deadline; past it 503 (default 30000)")
    p.add_argument("--max-context", type=_int("--max-context"), default=8192, metavar="N",
                   help="most tokens per sequence, prompt + output (default 8192)")
    p.add_argument("--kv-capacity", type=_kv_capacity, metavar="N|auto",
                   help="KV pool size in tokens, or 'auto' (default: max-concurrency x max-context)")
    p.add_argument("--kv-dtype", choices=["auto", "bf16", "fp8", "int8"], default="auto",
                   help="KV cache storage (default: the model dtype)")
    p.add_argument("--prefill-chunk", type=_int("--prefill-chunk"), default=8192, metavar="N",
                   help="most prompt tokens per prefill step (default 8192)")
    p.add_argument("--prefill-tokens-while-decoding", type=_int("--prefill-tokens-while-decoding"), default=1024,
                   metavar="N", help="most prompt tokens per step while others decode (their stall; default 1024)")
    p.add_argument("--device", help="torch device (default: cuda if available)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="compute dtype")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly")
    add_spec_options(p)
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not reuse KV pages and DeltaNet state of earlier prompts")
    p.add_argument("--checkpoint-slots", type=_int("--checkpoint-slots"), default=8, metavar="N",
                   help="DeltaNet state checkpoints kept for prefix reuse, beyond the lanes (default 8)")
    p.add_argument("--checkpoint-interval", type=_int("--checkpoint-interval"), default=4096, metavar="N",
                   help="also checkpoint every N tokens of a long prompt (default 4096)")
    p.add_argument("--host-cache-gib", type=float, default=0.0, metavar="N",
                   help="pinned host memory that evicted prefix checkpoints move to, and are restored from "
                        "(default 0: evicted checkpoints are dropped)")
    p.add_argument("--pause-host-gib", type=float, default=4.0, metavar="N",
                   help="pinned host memory for snapshots of requests paused when the KV pool runs out; "
                        "beyond it paused requests are recomputed (default 4)")
    p.add_argument("--host-prepin-gib", type=_float("--host-prepin-gib", 0.0), default=0.0, metavar="N",
                   help="pin this much of the host memory above at start-up, so that the first host copies "
                        "run at copy speed rather than at the ~1 GB/s of pinning fresh memory (default 0)")
    p.add_argument("--max-request-mib", type=_int("--max-request-mib"), default=ServerConfig.max_request_bytes >> 20,
                   metavar="N", help="request body limit; larger bodies get 413 (default %(default)s)")
    p.add_argument("--default-max-tokens", type=_int("--default-max-tokens"), default=8192, metavar="N",
                   help="output limit when a request sets none (default 8192)")
    p.add_argument("--no-thinking", action="store_true", help="thinking off unless a request turns it on")
    p.add_argument("--preserve-thinking", action="store_true", help="keep reasoning of closed turns in prompts")
    p.add_argument("--response-store-max-records", type=_int("--response-store-max-records", 0), default=1024,
                   metavar="N", help="Responses kept for previous_response_id (default 1024)")
    p.add_argument("--response-store-max-mib", type=_int("--response-store-max-mib", 0), default=256, metavar="N",
                   help="memory of the Responses store (default 256)")
    p.add_argument("--cors", action="store_true", help="answer CORS requests from any origin")
    v = p.add_argument_group("vision (images and videos; composite checkpoints only)")
    v.add_argument("--vision", action="store_true",
                   help="load the vision tower and accept image/video parts (URLs and data URIs; never local files)")
    v.add_argument("--max-media-bytes", type=_int("--max-media-bytes"), metavar="N",
                   help="encoded bytes of one image or video (default 64 MiB)")
    v.add_argument("--max-image-pixels", type=_int("--max-image-pixels"), metavar="N",
                   help="source width x height of one image (default 8192*8192)")
    v.add_argument("--max-video-frames", type=_int("--max-video-frames"), metavar="N",
                   help="frames sampled from one video (default 768)")
    v.add_argument("--max-media-items", type=_int("--max-media-items"), metavar="N",
                   help="images + videos per request (default 32)")
    v.add_argument("--max-media-tokens", type=_int("--max-media-tokens"), metavar="N",
                   help="merged vision tokens per request (default 16384)")
    v.add_argument("--media-fetch-timeout-s", type=_float("--media-fetch-timeout-s", 0.0, lo_open=True),
                   metavar="S", help="deadline of one http(s) media fetch, redirects included (default 15)")
    v.add_argument("--media-max-redirects", type=_int("--media-max-redirects", 0), metavar="N",
                   help="redirects one media fetch follows, each target re-checked (default 5)")
    v.add_argument("--allow-private-media", action="store_true",
                   help="also fetch media from loopback and private-network addresses (default: public only)")
    v.add_argument("--media-allowed-hosts", type=_host_list, metavar="HOSTS",
                   help="comma-separated hosts media URLs may name ('*.example.com': its subdomains)")
    v.add_argument("--no-remote-media", action="store_true", help="refuse http(s) media URLs (data URIs only)")
    v.add_argument("--media-workers", type=_int("--media-workers", 1), metavar="N",
                   help="threads fetching, decoding and preprocessing media, apart from text requests' (default 4)")
    p.add_argument("--switch-interval-ms", type=_float("--switch-interval-ms", 0.0, lo_open=True), default=0.5,
                   metavar="MS", help="how long one Python thread may hold the interpreter before the other gets it "
                   "(Python's default is 5 ms; the engine thread waits that long behind HTTP work; default 0.5)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    s = p.add_argument_group("sampling overrides (request fields win; defaults: the model's preset)")
    s.add_argument("--temperature", type=_float("--temperature", 0.0, 2.0), metavar="T")
    s.add_argument("--top-p", type=_float("--top-p", 0.0, 1.0, lo_open=True), metavar="P")
    s.add_argument("--top-k", type=_int("--top-k", 0), metavar="K")
    s.add_argument("--min-p", type=_float("--min-p", 0.0, 1.0), metavar="P")
    s.add_argument("--presence-penalty", type=_float("--presence-penalty", -2.0, 2.0), metavar="X")
    s.add_argument("--frequency-penalty", type=_float("--frequency-penalty", -2.0, 2.0), metavar="X")
    s.add_argument("--repetition-penalty", type=_float("--repetition-penalty", 0.0, lo_open=True), metavar="X")
    s.add_argument("--seed", type=int, metavar="N", help="seed of every request that sets none")
    s.add_argument("--greedy", action="store_true", help="temperature 0 unless a request sets one")
    p.set_defaults(func=run_serve)
    return p


def server_config(args: argparse.Namespace):
    from ninfer.api.config import SamplingOverrides, ServerConfig
    from ninfer.api.serve_ops import api_key

    sampling = SamplingOverrides(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 min_p=args.min_p, presence_penalty=args.presence_penalty,
                                 frequency_penalty=args.frequency_penalty,
                                 repetition_penalty=args.repetition_penalty, seed=args.seed, greedy=args.greedy)
    return ServerConfig(model_id=args.model_id, api_key=api_key(args), max_pending=args.max_pending,
                        pending_timeout_ms=args.pending_timeout_ms, max_request_bytes=args.max_request_mib << 20,
                        default_max_tokens=args.default_max_tokens, thinking=not args.no_thinking,
                        preserve_thinking=args.preserve_thinking, cors=args.cors,
                        response_store_max_records=args.response_store_max_records,
                        response_store_max_bytes=args.response_store_max_mib << 20, sampling=sampling)


_LIMIT_FLAGS = {"max_media_bytes": "max_media_bytes", "max_image_pixels": "max_image_pixels",
                "max_video_frames": "max_video_frames", "max_media_items": "max_media_items",
                "max_media_tokens": "max_media_tokens", "media_fetch_timeout_s": "fetch_timeout_s",
                "media_max_redirects": "max_redirects", "media_allowed_hosts": "media_allowed_hosts",
                "media_workers": "media_workers"}


def _host_list(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip().lower().removeprefix("[").removesuffix("]") for h in text.split(",") if h.strip())
    for host in hosts:
        if "/" in host or host.count(":") == 1:  # a URL or host:port (IPv6 literals have several colons)
            raise argparse.ArgumentTypeError(f"{host!r} is not a host name (no scheme, "
                                             "port or path)")
        if "*" in host and (not host.startswith("*.") or "*" in host[2:]):
            raise argparse.ArgumentTypeError(f"{host!r}: a wildcard is only '*.' at the "
                                             "start ('*.example.com')")
    if not hosts:
        raise argparse.ArgumentTypeError("no host given")
    return hosts


def vision_limits(args: argparse.Namespace):
    """``VisionLimits`` of the limit and media-policy flags (unset flags keep the defaults); local files are
    never read."""
    from ninfer.vision import VisionLimits

    given = {field: getattr(args, flag) for flag, field in _LIMIT_FLAGS.items()
             if getattr(args, flag, None) is not None}
    return VisionLimits(allow_local_files=False, allow_private_media=getattr(args, "allow_private_media", False),
                        allow_remote_media=not getattr(args, "no_remote_media", False), **given)


def run_serve(args: argparse.Namespace) -> None:
    import ninfer
    from ninfer.api.app import create_app
    from ninfer.api.serve_ops import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s  %(levelname)s  %(message)s")
    config = server_config(args)
    if config.model_id is None and args.model:
        config = _with_model_id(config, args.model)
    llm = ninfer.load(args.model, device=args.device, dtype=args.dtype, max_concurrency=args.max_concurrency,
                      max_context=args.max_context, kv_capacity=args.kv_capacity, kv_dtype=args.kv_dtype,
                      prefill_chunk=args.prefill_chunk, cuda_graphs=not args.no_cuda_graphs,
                      prefill_tokens_while_decoding=args.prefill_tokens_while_decoding,
                      prefix_cache=not args.no_prefix_cache, checkpoint_slots=args.checkpoint_slots,
                      checkpoint_interval=args.checkpoint_interval, host_cache_gib=args.host_cache_gib,
                      spec=args.spec, draft_tokens=args.draft_tokens,
                      pause_host_gib=args.pause_host_gib, host_prepin_gib=args.host_prepin_gib,
                      **({"vision": True, "vision_limits": vision_limits(args)} if args.vision else {}))
    app = create_app(llm, config)
    # The engine thread launches each step's kernels in Python; with Python's 5 ms switch interval the HTTP
    # thread could hold it off that long per hand-over (27B int4 on an H200, 512-token prompts: the HTTP
    # TTFT overhead over the library API went from +23.5% to +6.8% at 0.5 ms, docs/performance.md).
    sys.setswitchinterval(args.switch_interval_ms / 1e3)
    serve(app, args)


def _with_model_id(config, model: str):
    import dataclasses
    from pathlib import Path

    name = model.rstrip("/")
    return dataclasses.replace(config, model_id=name if "/" in name and not Path(name).exists() else Path(name).name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ninfer")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    from ninfer.checkpoint import CheckpointError
    from ninfer.config import ConfigError

    try:
        args.func(args)
    except (CheckpointError, ConfigError, ValueError) as err:
        print(f"ninfer: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
