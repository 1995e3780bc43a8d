"""HTTP serving: OpenAI Chat Completions and Responses, Anthropic Messages, metrics (Starlette + uvicorn).

The names below load on first use, so that the Python API, which shares this package's output streams
(``ninfer.api.output``), runs without the server's dependencies installed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ninfer.api.app import create_app
    from ninfer.api.config import SamplingOverrides, ServerConfig

__all__ = ["SamplingOverrides", "ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from ninfer.api.app import create_app

        return create_app
    if name in ("SamplingOverrides", "ServerConfig"):
        from ninfer.api import config

        return getattr(config, name)
    raise AttributeError(f"module 'ninfer.api' has no attribute {name!r}")
