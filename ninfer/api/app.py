"""The Starlette app: routes, API-key check, request ids, per-protocol error shapes, and the engine's lifespan.

``create_app(llm, config)`` starts an :class:`~ninfer.runtime.async_engine.AsyncEngine` (the
engine on its own thread) when the app starts and stops it when the app stops. Tests may pass
``engine=`` an object with the same ``generate`` / ``cancel`` / ``call`` / ``shutdown`` methods.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import time
from pathlib import Path
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ninfer.api import anthropic, openai_chat, openai_completions, openai_responses, request_id, tokenize
from ninfer.api.config import ServerConfig
from ninfer.api.errors import APIError, Protocol
from ninfer.api.metrics import Metrics
from ninfer.api.response_store import ResponseStore
from ninfer.api.service import ClientGone, Service

log = logging.getLogger("ninfer.api")
access_log = logging.getLogger("ninfer.api.access")
Handler = Callable[..., Awaitable[Response]]
# Seconds a client should wait before retrying a 429 / 503 (Anthropic: 529 / 504), by error code.
_RETRY_AFTER = {"server_shutting_down": 5, "engine_unavailable": 10}
_RETRY_STATUSES = (429, 503, 504, 529)


def _protocol(path: str) -> Protocol:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def _authorized(request: Request, key: str) -> bool:
    offered = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        offered = offered or auth[7:].strip()
    return offered is not None and hmac.compare_digest(offered.encode(), key.encode())


def _error_response(err: APIError, protocol: Protocol) -> JSONResponse:
    status = err.status_for(protocol)
    response = JSONResponse(err.body(protocol), status_code=status)
    if status in _RETRY_STATUSES:
        response.headers["retry-after"] = str(_RETRY_AFTER.get(err.code or "", 1))
    return response


def _endpoint(handler: Handler, path: str, *, auth: bool = True, with_store: bool = False,
              while_draining: bool = False) -> Callable[[Request], Any]:
    """Wrap a handler: request id, API key, refusal while shutting down, APIError -> protocol error body,
    response counts by route and status; no prompt logging."""
    async def route(request: Request) -> Response:
        protocol = _protocol(request.url.path)
        state = request.app.state
        rid = None
        began = time.perf_counter()
        try:
            rid = request.state.request_id = request_id.read(request)
            if not while_draining and state.service.drain.draining:
                raise APIError(503, "the server is shutting down; retry the request", code="server_shutting_down")
            if auth and state.config.api_key and not _authorized(request, state.config.api_key):
                raise APIError(401, "a valid API key is required (Authorization: Bearer KEY or x-api-key: KEY)",
                               code="invalid_api_key")
            args = (state.service, state.store) if with_store else (state.service,)
            response = await handler(request, *args)
        except APIError as err:
            if err.status >= 500:
                log.warning("request %s: %s %s -> %d %s", rid, request.method, request.url.path, err.status,
                            err.code)
            response = _error_response(err, protocol)
        except (ClientGone, ClientDisconnect):  # gone while queued or running, or before its body was in
            response = Response(status_code=499)
        except Exception:
            log.exception("request %s: internal error on %s %s", rid, request.method, request.url.path)
            response = _error_response(APIError(500, "internal server error", code="internal_error"), protocol)
        rid = rid or request_id.new()
        response.headers[request_id.HEADER] = rid
        if protocol == "anthropic":
            response.headers["request-id"] = rid
        state.service.metrics.responded(path, response.status_code)
        if state.access_log:
            _log_access(request, response.status_code, began, rid)
        return response
    return route


def _log_access(request: Request, status: int, began: float, rid: str) -> None:
    """One line per request: method, path, status, duration (to the response's start for a stream), id."""
    access_log.info("%s %s %d %.1fms %s", request.method, request.url.path, status,
                    (time.perf_counter() - began) * 1000, rid)


async def _health(request: Request, service: Service) -> Response:
    if service.drain.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503,
                            headers={"retry-after": str(_RETRY_AFTER["server_shutting_down"])})
    if not service.alive:
        return JSONResponse({"status": "unavailable"}, status_code=503,
                            headers={"retry-after": str(_RETRY_AFTER["engine_unavailable"])})
    return JSONResponse({"status": "ok"})


async def _metrics(request: Request, service: Service) -> Response:
    body = await service.metrics.render(service.engine, service.alive, service.in_flight)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def _model_card(service: Service, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": service.created, "owned_by": "ninfer",
            "max_model_len": service.max_context}


async def _models(request: Request, service: Service) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(service, n) for n in service.served_names]})


async def _model(request: Request, service: Service) -> Response:
    model_id = request.path_params["model_id"]
    if model_id not in service.served_names:
        raise APIError(404, f"model {model_id!r} does not exist; this server serves "
                            f"{', '.join(map(repr, service.served_names))}", code="model_not_found", param="model")
    return JSONResponse(_model_card(service, model_id))


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    service = getattr(request.app.state, "service", None)
    if service is not None:
        service.metrics.responded("unmatched", exc.status_code)  # no route: the raw path would be an unbounded label
    return _error_response(APIError(exc.status_code, message, code=code), _protocol(request.url.path))


def create_app(llm: Any, config: ServerConfig | None = None, *, engine: Any = None,
               served_model_names: list[str] | None = None, chat_template: str | None = None,
               strict_model_names: bool = False, access_log: bool = False) -> Starlette:
    """The server app for a loaded ``ninfer.LLM``.

    ``served_model_names``: the names ``/v1/models`` lists (default: ``config.model_id`` or the checkpoint
    directory's name); responses report the name the request asked for, and a request naming another
    model is still served unless ``strict_model_names`` (then 404 ``model_not_found``). ``chat_template``:
    a Jinja template (its text, or the path of a file holding it) replacing the checkpoint's.
    ``access_log``: one ``ninfer.api.access`` log line per request."""
    config = config or ServerConfig()
    names = _served_names(served_model_names, config.model_id or llm.model_dir.name)
    model_id = names[0]
    template = _chat_template(chat_template)
    _no_local_media(llm)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        own = engine is None
        if own:
            from ninfer.runtime.async_engine import AsyncEngine

            _widen_queue(llm, config)
            async_engine = AsyncEngine(llm.engine)
        else:
            async_engine = engine
        metrics = Metrics(model_id, llm.engine.config.max_concurrency, llm.engine.config.max_context)
        service = Service(llm, config, async_engine, metrics, model_id, names, template, strict_model_names)
        app.state.service, app.state.config, app.state.access_log = service, config, access_log
        app.state.store = ResponseStore(config.response_store_max_records, config.response_store_max_bytes)
        log.info("serving %s: %d lanes, context %d tokens", model_id, service.lanes, service.max_context)
        try:
            yield
        finally:
            if own:
                async_engine.shutdown()

    def route(path: str, handler: Handler, methods: list[str], **kw: Any) -> Route:
        return Route(path, _endpoint(handler, path, **kw), methods=methods)

    def store_route(path: str, handler: Handler, methods: list[str]) -> Route:
        return route(path, handler, methods, with_store=True)

    routes = [  # while shutting down /health answers 503 itself, and /metrics stays readable
        route("/health", _health, ["GET"], auth=False, while_draining=True),
        route("/metrics", _metrics, ["GET"], while_draining=True),
        route("/v1/models", _models, ["GET"]),
        route("/v1/models/{model_id:path}", _model, ["GET"]),
        route("/v1/chat/completions", openai_chat.handle, ["POST"]),
        route("/v1/completions", openai_completions.handle, ["POST"]),
        route("/tokenize", tokenize.tokenize, ["POST"]),
        route("/detokenize", tokenize.detokenize, ["POST"]),
        route("/tokenizer_info", tokenize.tokenizer_info, ["GET"]),
        route("/version", tokenize.version, ["GET"]),
        store_route("/v1/responses", openai_responses.create, ["POST"]),
        store_route("/v1/responses/input_tokens", openai_responses.input_tokens, ["POST"]),
        store_route("/v1/responses/compact", openai_responses.not_supported, ["POST"]),
        store_route("/v1/responses/{response_id}", openai_responses.get, ["GET"]),
        store_route("/v1/responses/{response_id}", openai_responses.delete, ["DELETE"]),
        store_route("/v1/responses/{response_id}/input_items", openai_responses.list_input_items, ["GET"]),
        store_route("/v1/responses/{response_id}/cancel", openai_responses.not_supported, ["POST"]),
        route("/v1/messages", anthropic.create, ["POST"]),
        route("/v1/messages/count_tokens", anthropic.count_tokens, ["POST"]),
    ]
    middleware = []
    if config.cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                                     expose_headers=["x-request-id", "request-id", "retry-after"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.served_names = names
    return app


def _served_names(names: list[str] | None, default: str) -> tuple[str, ...]:
    if names is None:
        return (default,)
    if isinstance(names, str) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"served_model_names must be a non-empty list of non-empty strings, got {names!r}")
    return tuple(dict.fromkeys(names))


def _chat_template(template: str | None) -> str | None:
    """The template text: ``template`` itself, or the file it names (vLLM's --chat-template takes either);
    a syntax error is raised here, before the server starts."""
    if template is None:
        return None
    if "{" not in template and Path(template).expanduser().is_file():
        template = Path(template).expanduser().read_text()
    import jinja2

    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"chat_template is not a valid Jinja template: {err}") from None
    return template


def _no_local_media(llm: Any) -> None:
    """Clients may send URLs and data URIs, never server-side paths: local file reads are turned off."""
    vision = getattr(llm, "vision", None)
    if vision is not None and vision.limits.allow_local_files:
        import dataclasses

        vision.limits = dataclasses.replace(vision.limits, allow_local_files=False)


def _widen_queue(llm: Any, config: ServerConfig) -> None:
    """The engine's own wait queue must hold at least the server's pending places (QueueFull is a 429 anyway)."""
    scheduler = getattr(llm.engine, "scheduler", None)
    if scheduler is not None and getattr(scheduler, "max_pending", None) is not None:
        scheduler.max_pending = max(scheduler.max_pending, config.max_pending + llm.engine.config.max_concurrency)
