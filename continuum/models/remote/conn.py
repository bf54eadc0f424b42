"""Plain request-and-answer HTTP for ``models.remote``: one kept-alive ``http.client`` connection per thread.

Why not httpx here: on loopback the round trip is most of what a remote call adds to the same call in-process (B30a,
target 2 ms a call), and httpx's request building, URL merging, cookie handling and its two writes per request (the
headers, then the body) cost ~0.3-0.5 ms of it. Here a request is one write of the headers and body together (and
``TCP_NODELAY``: no wait for an acknowledgement before it leaves), and the answer is read with ``http.client``'s
parser. Streams (server-sent events) stay on httpx (``client.Client.stream``).

A connection left idle past :data:`IDLE_S` is replaced before it is used: the server closes idle connections
(uvicorn after 5 s), and a request written into a closed one can only fail.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from typing import NamedTuple
from urllib.parse import urlsplit

__all__ = ["Answer", "Broken", "Connections", "Unreachable"]

IDLE_S = 4.0  # reuse a kept-alive connection only if it was used this recently (uvicorn closes them after 5 s by
# default, `continuum serve` after 30: this client also talks to other servers, and to older continuum ones)


class Answer(NamedTuple):
    status: int
    headers: dict[str, str]  # (names lower-case)
    body: bytes


class Unreachable(Exception):
    """No answer: no connection could be made, or the server did not answer within the timeout (``timed_out``)."""

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message)
        self.timed_out = timed_out


class Broken(Exception):
    """The connection broke after the request was (perhaps) sent: a kept-alive connection the server had closed, or a
    server that stopped mid-answer. Whether it may be sent again is the caller's decision."""


class _Local(threading.local):
    sock: socket.socket | None = None
    used: float = 0.0


class Connections:
    """Requests to ``base`` (``http://host:port`` or ``https://...``, any path prefix kept), each thread on its own
    kept-alive connection."""

    def __init__(self, base: str, headers: dict[str, str], timeout: float):
        url = urlsplit(base)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base!r}")
        self._https, self._host = url.scheme == "https", url.hostname
        self._port = url.port or (443 if self._https else 80)
        self._prefix = url.path.rstrip("/")
        host = url.netloc.rsplit("@", 1)[-1]
        self._head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, "Accept": "application/json",
                                                          "Content-Type": "application/json", **headers}.items())
        self._timeout = timeout
        self._local = _Local()

    def _socket(self) -> socket.socket:
        local, now = self._local, time.monotonic()
        if local.sock is not None and now - local.used > IDLE_S:
            self.close()
        if local.sock is None:
            sock = socket.create_connection((self._host, self._port), timeout=self._timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._https:
                import ssl

                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
            local.sock = sock
        local.used = now
        return local.sock

    def close(self) -> None:
        """Close this thread's connection (the others close with their threads)."""
        if self._local.sock is not None:
            self._local.sock.close()
            self._local.sock = None

    def request(self, method: str, path: str, body: bytes | None) -> Answer:
        """One request and its whole answer. Raises :class:`Unreachable` or :class:`Broken` (the connection closed)."""
        body = body or b""
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._head}Content-Length: {len(body)}\r\n\r\n"
        try:
            sock = self._socket()
        except TimeoutError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}", timed_out=True) from None
        except OSError as exc:  # (refused, no route)
            raise Unreachable(f"{type(exc).__name__}: {exc}", timed_out=False) from None
        try:
            sock.sendall(head.encode("latin-1") + body)
            response = http.client.HTTPResponse(sock, method=method)
            response.begin()
            data = response.read()
        except TimeoutError as exc:
            self.close()
            raise Unreachable(f"{type(exc).__name__}: {exc}", timed_out=True) from None
        except (OSError, http.client.HTTPException) as exc:  # (closed by the server, reset, a broken answer)
            self.close()
            raise Broken(f"{type(exc).__name__}: {exc}") from None
        if response.will_close:
            self.close()
        else:
            self._local.used = time.monotonic()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
