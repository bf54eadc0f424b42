"""The HTTP side of ``models.remote``: plain requests on kept-alive connections (``conn.py``), streams on a pooled
``httpx`` client, continuum's errors travelling by name, and the tokenizer fetched once (and kept on disk, by its
fingerprint, for the next process).

Failures become continuum errors that say what to do: a server that cannot be reached or does not answer in time is a
:class:`~continuum.errors.RemoteError` (nothing on the client changed: the call can be retried as it was); an error
the server raised from continuum (``{"error": {"code": "IncompleteGenerationError", ...}}``) is raised here as that
same class, with the server's message; a busy server (503, ``--max-queue``) is waited for, as its ``Retry-After``
asks, up to the call's timeout.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import httpx

from ... import errors
from ...errors import ContinuumError, RemoteError
from ...loop.arrivals import GATE
from .conn import Broken, Connections, Unreachable
from .wire import TUNNEL

__all__ = ["Client", "load_tokenizer"]

_BUSY_WAIT_S = 60.0  # the longest a call waits for a busy server (503 + Retry-After) before it gives up


class Client:
    """Requests to one ``continuum serve`` (``base``: its root or its ``/v1`` URL)."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 120.0):
        base = url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.http = httpx.Client(base_url=self.base, headers=headers, timeout=timeout)  # (streams)
        # plain requests: one write, one read on a kept-alive connection; through httpx where a proxy applies (httpx
        # honours HTTP(S)_PROXY and NO_PROXY, http.client does not)
        self.conns = None if _proxied(self.base) else Connections(self.base, headers, timeout)
        # behind a gateway that routes only the routes it knows (SMG: the OpenAI ones and SGLang's /generate), calls
        # go through POST /generate, which continuum serve answers for its native routes (set at the first 404)
        self.tunnel = False

    def _route(self, method: str, path: str, body: dict | None, stream: bool = False) -> tuple[str, str, dict | None]:
        if not self.tunnel:
            return method, path, body
        return "POST", TUNNEL, {"text": "", "stream": stream, "continuum": {"route": path, "body": body}}

    def close(self) -> None:
        if self.conns is not None:
            self.conns.close()
        self.http.close()

    def _plain(self, method: str, url: str, body: bytes | None) -> tuple[int, dict, bytes]:
        """One plain request: ``(status, headers, body)``; :class:`Broken` or :class:`Unreachable` as ``conn.py``."""
        if self.conns is not None:
            return self.conns.request(method, url, body)
        try:
            r = self.http.request(method, url, content=body, headers={"content-type": "application/json"})
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as exc:
            raise Broken(f"{type(exc).__name__}: {exc}") from None
        except httpx.TimeoutException as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}", timed_out=True) from None
        except httpx.TransportError as exc:
            raise Unreachable(f"{type(exc).__name__}: {exc}", timed_out=False) from None
        return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content

    def get(self, path: str) -> dict:
        return self._send("GET", path, None)

    def post(self, path: str, body: dict) -> dict:
        return self._send("POST", path, body)

    def _unreachable(self, exc: Exception, method: str, path: str) -> RemoteError:
        """The error for a request that got no answer: a timeout, or no connection at all (what to do, either way)."""
        if isinstance(exc, httpx.TimeoutException) or getattr(exc, "timed_out", False):
            return RemoteError(f"the server at {self.base} did not answer {method} {path} within {self.timeout:g} s "
                               f"({exc}). The state you passed is unchanged: call again once the "
                               f"server answers, or give models.remote(..., timeout=) more time for long calls.")
        return RemoteError(f"cannot reach the server at {self.base} ({type(exc).__name__}: {exc}). Start it "
                           f"(`continuum serve MODEL --port ...`) or check the URL; the state you passed is "
                           f"unchanged, so the same call works once the server answers (stored states survive "
                           f"a restart on the same --store).")

    def _send(self, method: str, path: str, body: dict | None) -> dict:
        with GATE.waiting():  # (a wait on the network: other callers' Python runs meanwhile, loop/arrivals.Gate)
            return self._send_now(method, path, body)

    def _send_now(self, method: str, path: str, body: dict | None) -> dict:
        deadline = time.monotonic() + _BUSY_WAIT_S
        retried = False
        while True:
            try:
                verb, url, sent = self._route(method, path, body)
                status, headers, data = self._plain(verb, url, None if sent is None else json.dumps(sent).encode())
            except Broken:
                # a connection that broke mid-request (a kept-alive one the server had closed): sent once more, safely,
                # as a generation carries its call id (the server answers a repeat from the store)
                if retried or (body is not None and "call" not in body):
                    raise RemoteError(f"the connection to {self.base} broke during {method} {path}; the state you "
                                      f"passed is unchanged: call again") from None
                retried = True
                continue
            except Unreachable as exc:  # (timeouts included)
                raise self._unreachable(exc, method, path) from None
            if status == 503 and time.monotonic() < deadline:  # busy: never the caller's fault
                time.sleep(min(float(headers.get("retry-after", "1") or 1), 5.0))
                continue
            if status == 404 and not self.tunnel and _unknown_url(data):
                self.tunnel = True  # a gateway that does not know the route: through its /generate
                continue
            return _answer(self.base, method, path, status, data)

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """``POST path`` answered by server-sent events: each event's JSON, up to ``[DONE]``. An error before the
        first event is raised as :meth:`post` raises it; an error event mid-stream as the class it names. A connection
        that breaks before any event is sent once more (the call id makes it safe); after one, it is a
        :class:`RemoteError` (the chunks already read cannot be taken back)."""
        with GATE.waiting():  # (a wait on the network, as in _send)
            yield from self._stream_now(path, body)

    def _stream_now(self, path: str, body: dict) -> Iterator[dict]:
        deadline = time.monotonic() + _BUSY_WAIT_S
        retried, started = False, False
        while True:
            try:
                method, url, sent = self._route("POST", path, body, stream=True)
                with self.http.stream(method, url, json=sent) as response:
                    if response.status_code == 503 and time.monotonic() < deadline:
                        time.sleep(min(float(response.headers.get("retry-after", "1") or 1), 5.0))
                        continue
                    if not response.is_success:
                        _answer(self.base, "POST", path, response.status_code, response.read())
                    for line in response.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            return
                        event = json.loads(data)
                        if isinstance(event, dict) and "error" in event:
                            _raise_error(self.base, "POST", path, 200, event["error"], data)
                        started = True
                        yield event
                    raise RemoteError(f"the stream of POST {self.base}{path} ended before its answer (the server "
                                      f"stopped?); the state you passed is unchanged: call again")
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
                if retried or started:
                    raise RemoteError(f"the connection to {self.base} broke during a stream of POST {path}; the state "
                                      f"you passed is unchanged: call again") from None
                retried = True
            except httpx.TransportError as exc:  # (timeouts included)
                raise self._unreachable(exc, "POST", path) from None


def _proxied(base: str) -> bool:
    """Whether a proxy from the environment applies to ``base`` (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY)."""
    import urllib.request
    from urllib.parse import urlsplit

    url = urlsplit(base)
    proxies = urllib.request.getproxies_environment()
    if not (proxies.get(url.scheme) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass_environment(url.hostname or "", proxies)  # type: ignore[attr-defined]


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _unknown_url(data: bytes) -> bool:
    """A 404 from a gateway that does not route the path (SMG's ``unknown_url``), not continuum's own 404."""
    body = _json(data)
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == "unknown_url"


def _answer(base: str, method: str, path: str, status: int, data: bytes) -> dict:
    """The JSON body of a 2xx, or the error it carries raised as continuum's own."""
    body = _json(data)
    if 200 <= status < 300 and isinstance(body, dict):
        return body
    error = body.get("error") if isinstance(body, dict) else None
    _raise_error(base, method, path, status, error, data.decode("utf-8", "replace"))


def _raise_error(base: str, method: str, path: str, status: int, error: Any, text: str) -> NoReturn:
    """Raise what an error body (``{"error": {"message", "code", ...}}``) says: continuum's class by name, or
    :class:`RemoteError`."""
    if not isinstance(error, dict):
        raise RemoteError(f"{method} {base}{path} answered {status} without continuum's JSON "
                          f"({text[:200]!r}): is this URL a `continuum serve` of this version?")
    message, code = str(error.get("message")), error.get("code")
    if code == "context_length_exceeded":
        raise errors.ContextLengthError(message)
    cls = getattr(errors, str(code), None)
    if isinstance(cls, type) and issubclass(cls, ContinuumError):
        raise _rebuilt(cls, message)
    if status == 401:
        raise RemoteError(f"the server at {base} refused the API key: {message} Pass models.remote(url, api_key=...).")
    if status == 404 and "Unknown route" in message:
        raise RemoteError(f"the server at {base} has no {path}: it is not a `continuum serve` with the native routes "
                          f"(update it), or the URL points elsewhere.")
    raise RemoteError(f"{method} {base}{path} failed with {status}: {message}")


def _rebuilt(cls: type[ContinuumError], message: str) -> ContinuumError:
    """``cls(message)``; a class whose constructor wants more (fields the server did not send) gets the message
    alone, so ``except`` clauses and ``str(exc)`` work as for the error raised locally."""
    try:
        return cls(message)
    except TypeError:
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        return exc


def _cache_root() -> Path:
    root = os.environ.get("CONTINUUM_REMOTE_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "continuum" / "remote-tokenizers"


def load_tokenizer(client: Client, info: dict) -> Any:
    """The server's tokenizer as a continuum :class:`~continuum.models.tokenizer.Tokenizer`: from the disk cache
    under its fingerprint, or fetched once (``GET /v1/continuum/tokenizer``) and kept there. Its fingerprint must be
    the server's (the same ids mean the same tokens), or :class:`RemoteError`."""
    from .wire import TOKENIZER

    fingerprint = str(info["tokenizer"]["fingerprint"])
    folder = _cache_root() / fingerprint
    if not (folder / "complete").exists():
        files = client.get(TOKENIZER)["files"]
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{fingerprint}-", dir=folder.parent))
        for name, data in files.items():
            if "/" in name or name.startswith("."):
                raise RemoteError(f"the server sent a tokenizer file named {name!r}: refused")
            (tmp / name).write_bytes(base64.b64decode(data))
        (tmp / "complete").write_text("")
        try:
            os.replace(tmp, folder)  # whole or absent: a concurrent fetch of the same tokenizer loses the race harmlessly
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    if (folder / "vocab.gguf").exists():  # a GGUF server's: llama.cpp's tokenizer over the GGUF's vocabulary
        from .gguf import load_gguf_tokenizer

        tokenizer = load_gguf_tokenizer(folder / "vocab.gguf")
    else:
        from transformers import AutoTokenizer

        from ..tokenizer import Tokenizer

        tokenizer = Tokenizer(AutoTokenizer.from_pretrained(str(folder)), info["tokenizer"].get("eos_token_ids"))
    if tokenizer.fingerprint != fingerprint:
        raise RemoteError(f"the tokenizer fetched from {client.base} loads here with fingerprint {tokenizer.fingerprint}, "
                          f"not the server's {fingerprint} (another transformers version?): ids would not mean the "
                          f"same tokens on both sides. Remove {folder} and retry, or align the versions.")
    return tokenizer
