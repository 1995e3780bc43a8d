"""Loopback HTTP listeners for the media-fetch tests: they count the connections they accept.

A :class:`Listener` binds one loopback address (127.x.y.z or ::1) on a free port and answers every
connection the same scripted way: ``ok`` (200 with ``body``), ``redirect`` (302 to ``location``),
``status`` (that HTTP status), ``trickle`` (headers, then one body byte per ``interval`` s) or
``trickle_headers`` (the status line one byte per ``interval`` s). It records the request heads it
read and when each connection was closed by the peer, and stops after ``lifetime_s`` at the latest.
With ``tls`` (a server ``ssl.SSLContext``, see :func:`self_signed`) it speaks HTTPS and records the
SNI names clients sent.
"""
from __future__ import annotations

import datetime
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Listener:
    host: str = "127.0.0.1"
    mode: str = "ok"
    body: bytes = b"hello"
    location: str = ""
    status: int = 404
    interval: float = 1.0
    lifetime_s: float = 60.0
    tls: ssl.SSLContext | None = None
    accepts: int = 0
    sni: list[str | None] = field(default_factory=list)
    heads: list[bytes] = field(default_factory=list)
    closed_at: list[float] = field(default_factory=list)  # time.monotonic() when a peer was seen gone

    def __post_init__(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((self.host, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        if self.tls is not None:
            self.tls.sni_callback = self._record_sni
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._deadline = time.monotonic() + self.lifetime_s
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _serve(self) -> None:
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                self.accepts += 1
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _read_head(self, conn: socket.socket) -> bytes:
        head = b""
        conn.settimeout(5)
        while b"\r\n\r\n" not in head and len(head) < 65536:
            chunk = conn.recv(4096)
            if not chunk:
                break
            head += chunk
        return head

    def _record_sni(self, _sock: Any, name: str | None, _context: Any) -> None:
        with self._lock:
            self.sni.append(name)

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                if self.tls is not None:
                    conn.settimeout(5)
                    conn = self.tls.wrap_socket(conn, server_side=True)
                head = self._read_head(conn)
                with self._lock:
                    self.heads.append(head)
                if self.mode == "ok":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
                                 % (len(self.body), self.body))
                elif self.mode == "redirect":
                    conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n"
                                 % self.location.encode())
                elif self.mode == "status":
                    conn.sendall(b"HTTP/1.1 %d Nope\r\nContent-Length: 0\r\n\r\n" % self.status)
                else:
                    self._trickle(conn)
            except OSError:
                with self._lock:
                    self.closed_at.append(time.monotonic())

    def _trickle(self, conn: socket.socket) -> None:
        if self.mode == "trickle":
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
            data = b"x" * 1000000
        else:
            data = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 1000000
        for i in range(len(data)):  # until the peer goes away (sendall raises) or the lifetime ends
            if self._stop.is_set() or time.monotonic() > self._deadline:
                return
            conn.sendall(data[i:i + 1])
            time.sleep(self.interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def self_signed(directory: Path, name: str) -> tuple[ssl.SSLContext, Path]:
    """A server context with a fresh self-signed certificate for ``name``, and the certificate file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    return context, cert_file
