"""http(s) media fetches that are safe by default (SSRF): checked addresses, one deadline, cancellable.

Each hop is parsed and checked (:mod:`ninfer.vision.fetch_policy`), its name resolved once, and the
connection made to exactly an address that passed the check, while the Host header and TLS SNI
carry the name. Redirects are followed by hand (each target checked the same way) up to
``max_redirects``. ``fetch_timeout_s`` bounds the whole fetch (resolution, connects, headers and
body of every hop): a timer shuts the socket down when it expires, so a server that trickles one
byte a second cannot hold it longer. A :class:`CancelToken` (the server sets one per request and
cancels it when the client disconnects) stops a fetch the same way.

What went wrong is logged, but a client only learns that the URL was not fetched: whether an
address was refused, closed, unreachable or slow must not be told apart from outside, or the
server becomes a port scanner of the networks it can reach.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import http.client
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ninfer.vision import fetch_policy
from ninfer.vision.fetch_policy import PolicyRefusal, Target, address_refusal, parse_target

if TYPE_CHECKING:
    from ninfer.vision.media import MediaKind, VisionLimits

log = logging.getLogger("ninfer.vision")
_CHUNK = 1 << 16
_REDIRECTS = {301, 302, 303, 307, 308}
_URL_SHOWN = 256  # characters of a URL repeated in an error message
_DNS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="ninfer-media-dns")  # a hung lookup waits here


class CancelToken:
    """Cancels the fetches of one request from another thread (its client disconnected)."""

    def __init__(self) -> None:
        self.cancelled = False
        self._lock = threading.Lock()
        self._sockets: set[Any] = set()

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)

    def _watch(self, sock: Any) -> None:
        with self._lock:
            self._sockets.add(sock)
            cancelled = self.cancelled
        if cancelled:
            _shutdown(sock)

    def _unwatch(self, sock: Any) -> None:
        with self._lock:
            self._sockets.discard(sock)


_token: contextvars.ContextVar[CancelToken | None] = contextvars.ContextVar("ninfer_media_cancel", default=None)


@contextlib.contextmanager
def cancellable(token: CancelToken) -> Iterator[None]:
    """Fetches made in this block (in this thread) stop when ``token`` is cancelled."""
    reset = _token.set(token)
    try:
        yield
    finally:
        _token.reset(reset)


def _shutdown(sock: Any) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a recv blocked in another thread
    except OSError:
        pass


def _short(url: str) -> str:
    return url if len(url) <= _URL_SHOWN else url[:_URL_SHOWN] + "…"


class _Hop:
    """One connection: the deadline timer and the cancel token both shut its socket down."""

    def __init__(self, deadline: float, token: CancelToken | None) -> None:
        self.deadline, self.token = deadline, token
        self.sock: Any = None
        self.expired = False
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._expire)
        self._timer.daemon = True
        self._timer.start()

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0 or self.expired:
            raise TimeoutError("the fetch deadline passed")
        if self.token is not None and self.token.cancelled:
            raise _Cancelled()
        return left

    def watch(self, sock: Any) -> None:
        if self.token is not None and self.sock is not None:
            self.token._unwatch(self.sock)
        self.sock = sock
        if self.token is not None:
            self.token._watch(sock)
        if self.expired:
            _shutdown(sock)

    def _expire(self) -> None:
        self.expired = True
        if self.sock is not None:
            _shutdown(self.sock)

    def close(self) -> None:
        self._timer.cancel()
        if self.token is not None and self.sock is not None:
            self.token._unwatch(self.sock)


class _Cancelled(Exception):
    pass


def _resolve(target: Target, hop: _Hop) -> list[str]:
    """The target's addresses, waited for in slices so that the deadline and a cancel still apply."""
    future = _DNS.submit(fetch_policy.resolve, target.host, target.port)  # looked up now: tests replace it
    while not future.done():
        concurrent.futures.wait([future], timeout=min(0.1, hop.remaining()))  # remaining() raises when over
    return future.result()


@functools.lru_cache(maxsize=1)
def tls_context() -> ssl.SSLContext:
    """The client TLS settings: system CAs, certificates verified against the URL's host name."""
    return ssl.create_default_context()


def _connect(target: Target, hop: _Hop, allow_private: bool) -> http.client.HTTPConnection:
    """A connection to the first address of the target's name that passes the policy check."""
    addresses = _resolve(target, hop)
    refusals = [address_refusal(a, allow_private) for a in addresses]
    allowed = [a for a, why in zip(addresses, refusals) if why is None]
    if not allowed:
        raise PolicyRefusal(f"{target.host} resolves to no allowed address ({'; '.join(filter(None, refusals))})")

    def create_connection(_address: Any, timeout: Any = None, _source: Any = None) -> socket.socket:
        last: OSError | None = None
        for address in allowed:  # exactly the checked addresses, never the name again
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            hop.watch(sock)
            try:
                sock.settimeout(hop.remaining())
                sock.connect((address, target.port))
                return sock
            except OSError as err:
                sock.close()
                last = err
        assert last is not None
        raise last

    if target.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            target.host, target.port, timeout=hop.remaining(), context=tls_context())
    else:
        conn = http.client.HTTPConnection(target.host, target.port, timeout=hop.remaining())
    conn._create_connection = create_connection  # type: ignore[attr-defined]  # the Host header/SNI keep the name
    conn.connect()
    hop.watch(conn.sock)  # TLS wraps the socket in a new object
    return conn


def _read_body(response: http.client.HTTPResponse, hop: _Hop, kind: MediaKind, url: str,
               limits: VisionLimits) -> bytes:
    from ninfer.vision.media import check_size

    length = response.headers.get("Content-Length")
    if length and length.isdigit():
        check_size(int(length), limits, f"the {kind} at {_short(url)}")
    buf = bytearray()
    while True:
        hop.sock.settimeout(hop.remaining())
        chunk = response.read1(_CHUNK)  # one recv at most: the deadline is checked between them
        if not chunk:
            hop.remaining()  # a socket shut down by the deadline or a cancel also ends in b""
            if response.length:  # read1 does not raise on a short body
                raise http.client.IncompleteRead(bytes(buf), response.length)
            return bytes(buf)
        buf += chunk
        check_size(len(buf), limits, f"the {kind} at {_short(url)}")  # an endless body stops at the limit


def _fetch_hops(url: str, kind: MediaKind, limits: VisionLimits, token: CancelToken | None) -> bytes:
    deadline = time.monotonic() + limits.fetch_timeout_s
    current = url
    for _ in range(limits.max_redirects + 1):
        target = parse_target(current, limits.media_allowed_hosts)
        hop = _Hop(deadline, token)
        try:
            conn = _connect(target, hop, limits.allow_private_media)
            try:
                conn.request("GET", target.path, headers={"User-Agent": "ninfer", "Accept": "*/*",
                                                          "Accept-Encoding": "identity", "Connection": "close"})
                response = conn.getresponse()
                location = response.headers.get("Location")
                if response.status in _REDIRECTS and location:
                    current = urllib.parse.urljoin(current, location.strip())
                    continue
                if response.status != 200:
                    raise PolicyRefusal(f"HTTP {response.status} {response.reason} from {target.url}")
                return _read_body(response, hop, kind, url, limits)
            finally:
                conn.close()
        except (OSError, http.client.HTTPException):  # a socket shut down mid-response fails either way
            if hop.expired:
                raise TimeoutError("the fetch deadline passed") from None
            if token is not None and token.cancelled:
                raise _Cancelled() from None
            raise
        finally:
            hop.close()
    raise PolicyRefusal(f"more than {limits.max_redirects} redirects")


def fetch(url: str, kind: MediaKind, limits: VisionLimits) -> bytes:
    """The body of an http(s) URL under ``limits``' media policy, or a ``MediaError``.

    Cancelled (``FetchCancelled``) when the :class:`CancelToken` of an enclosing :func:`cancellable` is.
    """
    from ninfer.vision.media import FetchCancelled, MediaError, MediaFetchError

    if not limits.allow_remote_media:
        raise MediaError(f"remote {kind} URLs are not accepted here (remote media are disabled); send a data URI")
    try:
        parse_target(url, limits.media_allowed_hosts)
    except PolicyRefusal as err:  # about the client's own URL alone: safe and useful to tell
        raise MediaError(f"the {kind} URL {_short(url)!r} is not allowed: {err}") from None
    token = _token.get()
    try:
        return _fetch_hops(url, kind, limits, token)
    except MediaError:
        raise
    except _Cancelled:
        raise FetchCancelled(f"the fetch of the {kind} at {_short(url)} was cancelled") from None
    # Refusals, socket errors, timeouts, TLS and protocol failures: logged in detail, told alike.
    except (PolicyRefusal, OSError, ValueError, http.client.HTTPException) as err:
        log.warning("media fetch of %s not done: %s: %s", _short(url), type(err).__name__, err)
        raise MediaFetchError(kind, _short(url)) from None
