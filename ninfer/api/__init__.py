"""HTTP serving: OpenAI Chat Completions and Responses, Anthropic Messages, metrics (Starlette + uvicorn)."""
from ninfer.api.app import create_app
from ninfer.api.config import SamplingOverrides, ServerConfig

__all__ = ["SamplingOverrides", "ServerConfig", "create_app"]
