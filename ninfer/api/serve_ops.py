"""The operations flags of ``ninfer serve`` (API key sources, read timeouts, graceful shutdown) and the
uvicorn server they configure.

API key precedence: ``--api-key`` (visible in ``ps``), else ``--api-key-file``, else the ``NINFER_API_KEY``
environment variable; none of them: no key is required. Both flags at once is an error, and so is an
empty key from any source (it would silently turn authentication off).
"""
from __future__ import annotations

import argparse
import os
from typing import Any

API_KEY_ENV = "NINFER_API_KEY"


def _key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("--api-key must not be empty")
    return text


def _key_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            key = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"--api-key-file {path!r} cannot be read: {err}") from None
    if not key:
        raise argparse.ArgumentTypeError(f"--api-key-file {path!r} is empty")
    if "\n" in key:
        raise argparse.ArgumentTypeError(f"--api-key-file {path!r} must hold the key on one line")
    return key


def _seconds(flag: str, lo: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects a number of seconds, got {text!r}") from None
        if not lo <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be >= {lo:g} seconds, got {text}")
        return value
    return parse


def add_ops_options(p: argparse.ArgumentParser) -> None:
    """``--api-key``, ``--api-key-file``, ``--shutdown-timeout``, ``--header-timeout``, ``--body-timeout``."""
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", type=_key, metavar="KEY",
                      help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (visible in ps: prefer "
                           f"--api-key-file or ${API_KEY_ENV})")
    keys.add_argument("--api-key-file", type=_key_file, metavar="PATH",
                      help=f"read the API key from this file (one line; overrides ${API_KEY_ENV})")
    p.add_argument("--shutdown-timeout", type=_seconds("--shutdown-timeout", 0.0), default=25.0, metavar="S",
                   help="on SIGTERM/SIGINT, let running requests finish this long, then end them as truncated "
                        "(default 25: inside Kubernetes' default 30 s grace period)")
    p.add_argument("--header-timeout", type=_seconds("--header-timeout", 0.1), default=30.0, metavar="S",
                   help="close connections whose request headers take longer than this (default 30)")
    p.add_argument("--body-timeout", type=_seconds("--body-timeout", 0.1), default=60.0, metavar="S",
                   help="close connections whose request body stalls longer than this between bytes (default 60)")


def api_key(args: argparse.Namespace) -> str | None:
    """The API key by precedence: --api-key, --api-key-file, $NINFER_API_KEY (ValueError if that is empty)."""
    if args.api_key is not None:
        return args.api_key
    if getattr(args, "api_key_file", None) is not None:
        return args.api_key_file
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty; unset it to serve without an API key")
    return key.strip() if key is not None else None


def serve(app: Any, args: argparse.Namespace) -> None:
    """Run ``app`` under uvicorn with the read timeouts and the graceful shutdown of these flags."""
    import uvicorn

    from ninfer.api.shutdown import GracefulServer
    from ninfer.api.timeouts import guarded_h11

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            http=guarded_h11(args.header_timeout, args.body_timeout))
    server = GracefulServer(config, lambda: drain_of(app), args.shutdown_timeout)
    server.run()


def drain_of(app: Any) -> Any:
    """The app's :class:`~ninfer.api.shutdown.Drain`, or None before its lifespan has started."""
    service = getattr(app.state, "service", None)
    return service.drain if service is not None else None
