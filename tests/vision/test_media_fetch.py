"""Media fetches are safe by default (SSRF): a refused address is never connected to.

Every fetch here goes to loopback listeners that count their connections; names that are not
loopback are resolved by a replaced ``fetch_policy.resolve`` and never reach the network.
"""
from __future__ import annotations

import socket
import ssl
import time

import pytest
from fetch_helpers import Listener, ipv6_loopback, self_signed

from ninfer.vision import MediaError, MediaFetchError, MediaLimitError, VisionLimits, address_refusal, host_allowed
from ninfer.vision import fetch as fetch_module
from ninfer.vision import fetch_policy
from ninfer.vision.media import read_source

PRIVATE_OK = VisionLimits(allow_private_media=True)
PUBLIC = "93.184.216.34"  # a global address: only ever a stand-in, rewired to a loopback listener


def _fetch(url: str, limits: VisionLimits = VisionLimits()) -> bytes:
    return read_source(url, "image", limits)


def _generic(err: BaseException, url: str) -> str:
    return str(err).replace(url, "<url>")


@pytest.mark.parametrize("address, why", [
    ("127.0.0.1", "loopback"), ("127.9.8.7", "loopback"), ("::1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"), ("100.64.0.1", "private"),
    ("fc00::1", "private"), ("fd12:3456::1", "private"), ("fec0::1", "private"), ("64:ff9b:1::a00:1", "private"),
    ("169.254.169.254", "link-local"), ("fe80::1", "link-local"), ("fe80::1%eth0", "link-local"),
    ("224.0.0.1", "multicast"), ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("0.1.2.3", "unspecified"), ("240.0.0.1", "reserved"), ("255.255.255.255", "reserved"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:169.254.169.254", "link-local"), ("::ffff:10.0.0.1", "private"),
    ("64:ff9b::7f00:1", "loopback"), ("64:ff9b::a9fe:a9fe", "link-local"), ("::127.0.0.1", "loopback"),
    ("2002:7f00:1::1", "loopback"), ("2002:a00:1::", "private"),
    ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),  # Teredo: the client address is stored inverted
    ("192.0.2.1", "private"), ("198.18.0.1", "private"),  # documentation, benchmarking: not global
])
def test_refused_addresses(address: str, why: str) -> None:
    reason = address_refusal(address)
    assert reason is not None and why in reason.replace("not globally routable", "private")
    always = why in ("link-local", "multicast", "unspecified", "reserved")
    assert (address_refusal(address, allow_private=True) is not None) == always


@pytest.mark.parametrize("address", ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8",
                                     "64:ff9b::808:808", "2002:808:808::1"])
def test_public_addresses_pass(address: str) -> None:
    assert address_refusal(address) is None


def test_host_allowlist_matching() -> None:
    hosts = ("img.example.com", "*.cdn.example")
    assert host_allowed("IMG.example.com.", hosts) and host_allowed("a.b.cdn.example", hosts)
    assert not host_allowed("cdn.example", hosts) and not host_allowed("evilcdn.example", hosts)
    assert not host_allowed("img.example.com.evil", hosts) and host_allowed("anything", ())
    assert host_allowed("xn--bcher-kva.example", ("bücher.example",))
    assert host_allowed("a.xn--bcher-kva.example", ("*.bücher.example",))


def test_internationalized_names_go_out_in_idna_form(public_stand_in, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    monkeypatch.setattr(fetch_policy, "resolve", lambda host, port: asked.append(host) or [PUBLIC])
    with Listener(body=b"idn") as server:
        public_stand_in[PUBLIC, 80] = ("127.0.0.1", server.port)
        assert _fetch("http://Bücher.example/a.png") == b"idn"
        assert asked == ["xn--bcher-kva.example"] and b"Host: xn--bcher-kva.example\r\n" in server.heads[0]


def _loopback_hosts() -> list[tuple[str, str]]:
    """(listener address, host as written in the URL)."""
    cases = [("127.0.0.1", "127.0.0.1"), ("127.3.4.5", "127.3.4.5"), ("127.0.0.1", "localhost"),
             ("127.0.0.1", "2130706433"), ("127.0.0.1", "0x7f000001"), ("127.0.0.1", "0177.0.0.1"),
             ("127.0.0.1", "127.1"), ("127.0.0.1", "[::ffff:127.0.0.1]"), ("127.0.0.1", "[::ffff:7f00:1]")]
    if ipv6_loopback():
        cases += [("::1", "[::1]"), ("::1", "[0:0::1]")]
    return cases


@pytest.mark.parametrize("bind, host", _loopback_hosts())
def test_loopback_forms_are_never_connected(bind: str, host: str) -> None:
    with Listener(bind) as server:
        url = f"http://{host}:{server.port}/a.png"
        with pytest.raises(MediaFetchError):
            _fetch(url)
        assert server.accepts == 0
        assert _fetch(url, PRIVATE_OK) == b"hello" and server.accepts == 1  # the opt-in reaches it: it was counted


def test_no_remote_media_refuses_before_connecting() -> None:
    with Listener() as server:
        with pytest.raises(MediaError, match="remote image URLs are not accepted"):
            _fetch(server.url + "/a.png", VisionLimits(allow_private_media=True, allow_remote_media=False))
        assert server.accepts == 0


def test_allowlist_gates_first_hop_and_redirects() -> None:
    with Listener() as target, Listener(mode="redirect") as first:
        first.location = f"http://localhost:{target.port}/b.png"  # loopback, but not in the allowlist
        limits = VisionLimits(allow_private_media=True, media_allowed_hosts=("127.0.0.1",))
        with pytest.raises(MediaFetchError):
            _fetch(first.url + "/a.png", limits)
        assert first.accepts == 1 and target.accepts == 0
        with pytest.raises(MediaError, match="'localhost' is not in the media allowlist"):
            _fetch(first.location, limits)  # the client's own URL: told precisely, still not connected
        assert target.accepts == 0
        first.location = f"{target.url}/b.png"
        assert _fetch(first.url + "/a.png", limits) == b"hello" and target.accepts == 1


@pytest.fixture()
def public_stand_in(monkeypatch: pytest.MonkeyPatch):
    """Connections to ``PUBLIC:port`` land on a loopback listener; anything else non-loopback fails the test."""
    routes: dict[tuple[str, int], tuple[str, int]] = {}
    real_socket = socket.socket

    class RoutedSocket(real_socket):
        def connect(self, address):  # type: ignore[override]
            host, port = address[0], address[1]
            if (host, port) in routes:
                return super().connect(routes[host, port])
            assert host in ("127.0.0.1", "::1") or host.startswith("127."), f"connect to {host} in a test"
            return super().connect(address)

    monkeypatch.setattr(fetch_module.socket, "socket", RoutedSocket)
    return routes


def test_redirect_to_a_forbidden_address_is_not_followed(public_stand_in, monkeypatch: pytest.MonkeyPatch) -> None:
    real = fetch_policy.resolve  # loopback names and literals only: nothing leaves the host
    monkeypatch.setattr(fetch_policy, "resolve", lambda host, port: [PUBLIC] if host == "media.example"
                        else real(host, port))
    with Listener("127.0.0.2") as forbidden, Listener(mode="redirect") as first:
        public_stand_in[PUBLIC, 8080] = ("127.0.0.1", first.port)
        port = forbidden.port
        locations = [f"{forbidden.url}/x.png", f"http://2130706434:{port}/", f"http://[::ffff:127.0.0.2]:{port}/",
                     f"http://localhost:{port}/", f"ftp://127.0.0.2:{port}/x.png", f"//127.0.0.2:{port}/x.png"]
        for location in locations:
            first.location = location
            with pytest.raises(MediaFetchError) as err:
                _fetch("http://media.example:8080/a.png")
            assert "127.0.0.2" not in str(err.value) and str(port) not in str(err.value)  # nothing of the target
        assert forbidden.accepts == 0 and first.accepts == len(locations)
        head = first.heads[0]
        assert head.startswith(b"GET /a.png HTTP/1.1\r\n") and b"Host: media.example:8080\r\n" in head


def test_redirect_chain_is_bounded() -> None:
    with Listener(mode="redirect") as loop:
        loop.location = f"{loop.url}/again"
        with pytest.raises(MediaFetchError):
            _fetch(loop.url + "/a.png", VisionLimits(allow_private_media=True, max_redirects=3))
        assert loop.accepts == 4


def test_dns_rebinding_connects_to_the_checked_address(public_stand_in, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = iter([[PUBLIC], ["127.0.0.1"], ["127.0.0.1"]])
    calls: list[str] = []

    def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)
        return next(answers)
    monkeypatch.setattr(fetch_policy, "resolve", rebinding)
    with Listener() as rebind_target, Listener(body=b"public") as public:
        public_stand_in[PUBLIC, rebind_target.port] = ("127.0.0.1", public.port)
        assert _fetch(f"http://rebind.example:{rebind_target.port}/a.png") == b"public"
        assert calls == ["rebind.example"] and rebind_target.accepts == 0 and public.accepts == 1
        assert f"Host: rebind.example:{rebind_target.port}\r\n".encode() in public.heads[0]


def test_https_sends_the_name_as_sni_and_verifies_it(public_stand_in, monkeypatch, tmp_path) -> None:
    server_tls, cert = self_signed(tmp_path, "media.example")
    monkeypatch.setattr(fetch_module, "tls_context", lambda: ssl.create_default_context(cafile=str(cert)))
    monkeypatch.setattr(fetch_policy, "resolve", lambda host, port: [PUBLIC])
    with Listener(tls=server_tls, body=b"secure") as tls_server:
        public_stand_in[PUBLIC, 443] = ("127.0.0.1", tls_server.port)
        assert _fetch("https://media.example/a.png") == b"secure"
        assert tls_server.sni == ["media.example"] and b"Host: media.example\r\n" in tls_server.heads[0]
        with pytest.raises(MediaFetchError):  # the certificate is for media.example: other names fail
            _fetch("https://other.example/a.png")
        assert tls_server.sni == ["media.example", "other.example"] and len(tls_server.heads) == 1


def test_a_name_with_any_refused_address_uses_only_the_allowed_ones(public_stand_in, monkeypatch) -> None:
    with Listener() as loopback, Listener(body=b"public") as public:
        monkeypatch.setattr(fetch_policy, "resolve", lambda host, port: ["127.0.0.1", PUBLIC])
        public_stand_in[PUBLIC, loopback.port] = ("127.0.0.1", public.port)
        assert _fetch(f"http://mixed.example:{loopback.port}/") == b"public" and loopback.accepts == 0


@pytest.mark.parametrize("mode", ["trickle", "trickle_headers"])
def test_the_deadline_covers_the_whole_fetch(mode: str) -> None:
    with Listener(mode=mode, interval=1.0, lifetime_s=20) as slow:
        start = time.monotonic()
        with pytest.raises(MediaFetchError):
            _fetch(slow.url + "/a.png", VisionLimits(allow_private_media=True, fetch_timeout_s=2.0))
        took = time.monotonic() - start
        assert 1.9 <= took < 3.0, took
        deadline = time.monotonic() + 4
        while not slow.closed_at and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.closed_at, "the server still sends to the fetch"


def test_closed_port_policy_refusal_and_http_errors_read_alike() -> None:
    with Listener() as server, Listener(mode="status", status=404) as missing, Listener(mode="status",
                                                                                       status=500) as broken:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
        closed.close()
        messages = set()
        cases = [(f"http://127.0.0.1:{closed_port}/a.png", PRIVATE_OK), (server.url + "/a.png", VisionLimits()),
                 (missing.url + "/a.png", PRIVATE_OK), (broken.url + "/a.png", PRIVATE_OK)]
        for url, limits in cases:
            with pytest.raises(MediaFetchError) as err:
                _fetch(url, limits)
            assert err.value.limit is None
            messages.add(_generic(err.value, url))
        assert len(messages) == 1 and "was not fetched" in messages.pop()
        assert server.accepts == 0


def test_body_limits_still_name_the_limit() -> None:
    with Listener(body=b"x" * 5000) as server:
        with pytest.raises(MediaLimitError, match="max_media_bytes"):
            _fetch(server.url + "/a.png", VisionLimits(allow_private_media=True, max_media_bytes=1000))


@pytest.mark.parametrize("url, message", [
    ("http://user:pw@example.com/a.png", "credentials"), ("http://:80/a.png", "no host"),
    ("http://example.com:99999/a.png", "malformed URL"),
])
def test_bad_urls_are_told_precisely_without_a_lookup(url: str, message: str, monkeypatch) -> None:
    monkeypatch.setattr(fetch_policy, "resolve", lambda host, port: pytest.fail("resolved"))
    with pytest.raises(MediaError, match=message):
        _fetch(url)


def test_a_cancelled_job_stops_its_fetch() -> None:
    import asyncio

    from ninfer.vision import FetchCancelled, MediaJobs

    jobs = MediaJobs(1)
    limits = VisionLimits(allow_private_media=True, fetch_timeout_s=30.0)
    with Listener(mode="trickle", interval=0.2, lifetime_s=30) as slow:
        async def main() -> None:
            url = slow.url + "/a.png"
            task = asyncio.ensure_future(jobs.run(lambda: _fetch(url, limits)))
            await asyncio.sleep(0.5)
            task.cancel()  # the awaiting request task is cancelled
            with pytest.raises(asyncio.CancelledError):
                await task
            gone = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(0.5, gone.set_result, None)  # a disconnect watcher fires
            with pytest.raises(FetchCancelled):
                await jobs.run(lambda: _fetch(url, limits), gone)
        start = time.monotonic()
        asyncio.run(main())
        assert time.monotonic() - start < 3.0
        deadline = time.monotonic() + 3
        while len(slow.closed_at) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.accepts == 2 and len(slow.closed_at) == 2
    jobs.shutdown()


def test_serve_flags_map_onto_the_media_policy() -> None:
    import argparse

    from ninfer.api.cli import add_serve_parser, vision_limits

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    limits = vision_limits(parser.parse_args(["serve", "m", "--vision"]))
    assert (limits.allow_private_media, limits.allow_remote_media, limits.media_allowed_hosts) == (False, True, ())
    args = parser.parse_args(["serve", "m", "--vision", "--allow-private-media", "--no-remote-media",
                              "--media-allowed-hosts", "img.example.com, *.CDN.example,[::1]",
                              "--media-max-redirects", "2", "--media-fetch-timeout-s", "3", "--media-workers", "8"])
    limits = vision_limits(args)
    assert limits.allow_private_media and not limits.allow_remote_media and limits.max_redirects == 2
    assert limits.media_workers == 8
    assert limits.media_allowed_hosts == ("img.example.com", "*.cdn.example", "::1") and limits.fetch_timeout_s == 3
    for bad in ("http://a.example", "a.example:8080", "a.*.example", ","):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "m", "--vision", "--media-allowed-hosts", bad])
