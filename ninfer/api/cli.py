"""``ninfer serve MODEL``: load a checkpoint and serve it over HTTP.

``add_serve_parser(subparsers)`` adds the subcommand to a parser; ``run_serve(args)`` runs it.
``python -m ninfer.api.cli serve MODEL ...`` works on its own as well.
"""
from __future__ import annotations

import argparse
import sys

from ninfer.api.config import ServerConfig
from ninfer.cli_options import (
    HelpFormatter,
    add_engine_options,
    add_log_level_option,
    add_model_argument,
    add_model_options,
    add_sampling_options,
    add_template_option,
    engine_options,
    number,
    positive,
    read_chat_template,
    set_log_level,
)

SERVE_EXAMPLES = """examples:
  ninfer serve Qwen/Qwen3.6-27B --max-concurrency 4 --max-context 32768
  ninfer serve ./my-model --port 9000 --api-key secret --no-thinking
  curl http://127.0.0.1:8080/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'
"""


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from ninfer.api.serve_ops import add_ops_options

    p = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI and Anthropic APIs)",
                              description="Serve OpenAI Chat Completions / Responses and Anthropic Messages.",
                              epilog=SERVE_EXAMPLES, formatter_class=HelpFormatter)
    add_model_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=positive("--port", 0), default=8080, help="listen port (default 8080)")
    add_ops_options(p)
    p.add_argument("--model-id", metavar="ID", help="public model name (default: the checkpoint directory name)")
    p.add_argument("--max-pending", "--max-pending-requests", dest="max_pending", type=positive("--max-pending", 0),
                   default=16, metavar="N", help="waiting requests beyond the lanes; more get 429 (default 16)")
    p.add_argument("--pending-timeout-ms", type=positive("--pending-timeout-ms"), default=30000, metavar="N",
                   help="admission deadline; past it 503 (default 30000)")
    add_model_options(p)
    add_engine_options(p)
    p.add_argument("--max-request-mib", type=positive("--max-request-mib"),
                   default=ServerConfig.max_request_bytes >> 20, metavar="N", help="request body limit; larger bodies get 413 (default %(default)s)")
    p.add_argument("--default-max-tokens", type=positive("--default-max-tokens"), default=8192, metavar="N",
                   help="output limit when a request sets none (default 8192)")
    p.add_argument("--no-thinking", action="store_true", help="thinking off unless a request turns it on")
    p.add_argument("--preserve-thinking", action="store_true", help="keep reasoning of closed turns in prompts")
    p.add_argument("--response-store-max-records", type=positive("--response-store-max-records", 0), default=1024,
                   metavar="N", help="Responses kept for previous_response_id (default 1024)")
    p.add_argument("--response-store-max-mib", type=positive("--response-store-max-mib", 0), default=256, metavar="N",
                   help="memory of the Responses store (default 256)")
    p.add_argument("--cors", action="store_true", help="answer CORS requests from any origin")
    v = p.add_argument_group("vision (images and videos; composite checkpoints only)")
    v.add_argument("--vision", action="store_true",
                   help="load the vision tower and accept image/video parts (URLs and data URIs; never local files)")
    v.add_argument("--max-media-bytes", type=positive("--max-media-bytes"), metavar="N",
                   help="encoded bytes of one image or video (default 64 MiB)")
    v.add_argument("--max-image-pixels", type=positive("--max-image-pixels"), metavar="N",
                   help="source width x height of one image (default 8192*8192)")
    v.add_argument("--max-video-frames", type=positive("--max-video-frames"), metavar="N",
                   help="frames sampled from one video (default 768)")
    v.add_argument("--max-media-items", type=positive("--max-media-items"), metavar="N",
                   help="images + videos per request (default 32)")
    v.add_argument("--max-media-tokens", type=positive("--max-media-tokens"), metavar="N",
                   help="merged vision tokens per request (default 16384)")
    v.add_argument("--media-fetch-timeout-s", type=number("--media-fetch-timeout-s", 0.0, lo_open=True),
                   metavar="S", help="deadline of one http(s) media fetch, redirects included (default 15)")
    v.add_argument("--media-max-redirects", type=positive("--media-max-redirects", 0), metavar="N",
                   help="redirects one media fetch follows, each target re-checked (default 5)")
    v.add_argument("--allow-private-media", action="store_true",
                   help="also fetch media from loopback and private-network addresses (default: public only)")
    v.add_argument("--media-allowed-hosts", type=_host_list, metavar="HOSTS",
                   help="comma-separated hosts media URLs may name ('*.example.com': its subdomains)")
    v.add_argument("--no-remote-media", action="store_true", help="refuse http(s) media URLs (data URIs only)")
    v.add_argument("--media-workers", type=positive("--media-workers", 1), metavar="N",
                   help="threads fetching, decoding and preprocessing media, apart from text requests' (default 4)")
    p.add_argument("--switch-interval-ms", type=number("--switch-interval-ms", 0.0, lo_open=True), default=0.5,
                   metavar="MS", help="how long one Python thread may hold the interpreter before the other gets it "
                   "(Python's default is 5 ms; the engine thread waits that long behind HTTP work; default 0.5)")
    add_log_level_option(p, default="info")
    add_template_option(p)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="public model name(s): the first is the one responses carry, the others are "
                        "aliases (vLLM's flag; default: the checkpoint directory name)")
    add_sampling_options(p, "sampling overrides (request fields win; defaults: the model's preset)")
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

    set_log_level(args)
    if args.served_model_name and args.model_id:
        raise ValueError("--served-model-name conflicts with --model-id: give the public name once")
    config = server_config(args)
    if config.model_id is None and args.model and not args.served_model_name:
        config = _with_model_id(config, args.model)
    options = engine_options(args)  # before loading: a bad combination fails fast, naming the flags
    for dest in (*_LIMIT_FLAGS, "allow_private_media", "no_remote_media"):
        if getattr(args, dest, None) not in (None, False) and not args.vision:
            raise ValueError(f"--{dest.replace('_', '-')} needs --vision")
    template = read_chat_template(args)
    llm = ninfer.load(args.model, device=args.device, dtype=args.dtype, **options,
                      **({"vision": True, "vision_limits": vision_limits(args)} if args.vision else {}))
    app = create_app(llm, config, served_model_names=args.served_model_name, chat_template=template)
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
