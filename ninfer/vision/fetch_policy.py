"""Which remote media a fetch may reach: URL schemes, the host allowlist and the resolved addresses.

Names are resolved by :func:`resolve` alone (tests replace it), once per hop; the fetch then connects
to exactly an address :func:`address_refusal` accepted, so a name cannot resolve to something else
between the check and the connection (DNS rebinding).
"""
from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from dataclasses import dataclass

SCHEMES = {"http": 80, "https": 443}
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052 well-known prefix: the IPv4 address is the low 32 bits
_NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215 local-use prefix: a site's own translators
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated ::a.b.c.d
_THIS_NETWORK = ipaddress.IPv4Network("0.0.0.0/8")  # Linux connects 0.x.x.x to the local host


def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to (IP literals, decimal/hex IPv4 forms and names alike)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, NAT64, 6to4, Teredo, IPv4-compatible)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64 or (ip in _IPV4_COMPATIBLE and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return None


def address_refusal(address: str, allow_private: bool = False) -> str | None:
    """Why a resolved address must not be connected to, or None when it may.

    Always refused: unspecified, multicast, link-local (cloud metadata services live there), reserved
    and 0.0.0.0/8. Loopback, private and other non-global addresses only with ``allow_private``. An
    IPv6 address embedding an IPv4 one is judged by the IPv4 address.
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return f"{address!r} is not an IP address"
    if isinstance(ip, ipaddress.IPv6Address) and (v4 := _embedded_v4(ip)) is not None:
        reason = address_refusal(str(v4), allow_private)
        return None if reason is None else f"{ip} embeds {reason}"
    if ip.is_unspecified or (isinstance(ip, ipaddress.IPv4Address) and ip in _THIS_NETWORK):
        return f"{ip} is unspecified"
    if ip.is_multicast:
        return f"{ip} is multicast"
    if ip.is_link_local:
        return f"{ip} is link-local"
    if ip.is_loopback:
        return None if allow_private else f"{ip} is loopback"
    local = ip in _NAT64_LOCAL or (isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local)
    if ip.is_reserved and not local:  # ::/8 (which holds the local-use NAT64 prefix), 240.0.0.0/4, ...
        return f"{ip} is reserved"
    if ip.is_private or not ip.is_global or local:
        return None if allow_private else f"{ip} is private or not globally routable"
    return None


def _ascii_host(host: str) -> str:
    """``host`` as sent on the wire: internationalized names in their IDNA (``xn--``) form."""
    if host.isascii():
        return host.lower()
    try:
        return host.encode("idna").decode("ascii")
    except UnicodeError:
        raise PolicyRefusal(f"{host!r} is not a valid host name") from None


def host_allowed(host: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``host`` matches the allowlist: exact names, or ``*.example.com`` for any subdomain of it.

    An empty allowlist allows every host (the address check still applies).
    """
    if not patterns:
        return True
    host = host.lower().rstrip(".")
    for pattern in patterns:
        pattern = pattern.lower().rstrip(".")
        if not pattern.isascii():
            wildcard = pattern.startswith("*.")
            pattern = ("*." if wildcard else "") + pattern[2 * wildcard:].encode("idna").decode("ascii")
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and len(host) > len(pattern) - 1:
                return True
        elif host == pattern:
            return True
    return False


@dataclass(frozen=True)
class Target:
    """One hop of a fetch: where to connect and what to ask for."""

    url: str
    scheme: str
    host: str  # as sent in the Host header and SNI (IPv6 literals without brackets)
    port: int
    path: str  # path and query


class PolicyRefusal(Exception):
    """A hop the media policy does not allow; the message is for the server log only."""


def parse_target(url: str, allowed_hosts: tuple[str, ...]) -> Target:
    """Split ``url`` into a :class:`Target`, checking its scheme and host (not yet its addresses)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise PolicyRefusal(f"malformed URL ({err})") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise PolicyRefusal(f"scheme {scheme!r} is not http(s)")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise PolicyRefusal("the URL has no host")
    host = _ascii_host(host)
    if parts.username is not None or parts.password is not None:
        raise PolicyRefusal("credentials in the URL")
    if not host_allowed(host, allowed_hosts):
        raise PolicyRefusal(f"host {host!r} is not in the media allowlist")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(url, scheme, host, port or SCHEMES[scheme], path)
