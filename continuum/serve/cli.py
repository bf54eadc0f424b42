"""``continuum serve MODEL``: load a model and serve it with uvicorn (see ``--help`` and docs/serve.md)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["main", "parse_age", "parser"]

logger = logging.getLogger("continuum.serve")


def _store_location(store: str) -> Path | str:
    """A postgresql:// URL as given; anything else is a folder."""
    return store if store.startswith(("postgresql://", "postgres://")) else Path(store).expanduser()


def _default_store() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "continuum", "serve")


def parse_age(spec: str) -> float | None:
    """``"30d"``, ``"12h"``, ``"90m"``, ``"3600s"`` or seconds; ``"0"``/``"none"``: no limit."""
    if spec.lower() in ("0", "none", "off"):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", spec.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"an age like '30d', '12h', '90m' or '3600s', got {spec!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


# uvicorn's own default (5 s) is what httpx's pool (OpenAI's clients) keeps an idle connection for: a client could send
# its next request on a connection the server closed at the same instant ("Server disconnected without sending a
# response"; seen in test_serve_load under a profiler). The server outlasts the clients' pools instead (SMG's is 3 s).
KEEP_ALIVE_S = 30


def _seconds(spec: str) -> int:
    if not spec.isdigit() or int(spec) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of seconds, at least 1, got {spec!r}")
    return int(spec)


def _size(spec: str) -> int | None:
    from ..models.budget import parse_budget

    if spec.lower() in ("0", "none", "off"):
        return None
    try:
        value = parse_budget(int(spec) if spec.isdigit() else spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="continuum serve", description="An OpenAI-compatible server whose conversations "
                                "are continuous states (docs/serve.md).")
    p.add_argument("model", help="a Hugging Face hub id, a local model folder, or a .gguf file (served on llama.cpp)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[], dest="api_keys",
                   help="accept 'Authorization: Bearer KEY' (repeatable); none given: no authentication")
    p.add_argument("--store", default=_default_store(),
                   help="the response store: a folder (default %(default)s) or a postgresql:// URL shared by replicas "
                   "(docs/scaleout.md)")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the folder's name)")
    p.add_argument("--prefix-cache", default=None, help="byte budget of the model's prefix cache, e.g. 512MiB (default off)")
    p.add_argument("--state-memory", type=_size, default=1 << 30,
                   help="byte budget of response states kept in memory, least recently used out (default 1GiB)")
    p.add_argument("--retention-age", type=parse_age, default=30 * 86400.0,
                   help="delete stored responses older than this (default 30d; 'none': keep)")
    p.add_argument("--retention-bytes", type=_size, default=10 << 30,
                   help="delete the oldest responses while state files exceed this (default 10GiB; 'none': no limit)")
    p.add_argument("--retention-interval", type=parse_age, default=60.0,
                   help="time between retention passes, which run on a thread of their own, never inside a request "
                        "(default 60s; 'none': this server runs none, e.g. one replica of several does)")
    p.add_argument("--store-kv", choices=("full", "none"), default="full",
                   help="what a stored response keeps of its new tokens: 'full' their KV cache (continuing reads it), "
                        "'none' the tokens only (continuing recomputes the cache: on a GPU a prefill beats reading "
                        "gigabytes); default full")
    p.add_argument("--dtype", default=None, help="weights' dtype (float32, bfloat16...; default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cpu)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (for models without one)")
    p.add_argument("--n-ctx", type=int, default=None,
                   help="GGUF: KV cells shared by every live conversation (default: min(trained context, 8192))")
    p.add_argument("--threads", type=int, default=None, help="GGUF: llama.cpp's CPU threads (default: the cores available)")
    p.add_argument("--idle-cells", type=_idle_cells, default="default",
                   help="GGUF: KV cells stored conversations keep resident beside the running ones (default 256; 'none': "
                        "all); past it the least recently used go to host memory, since every decode's attention runs "
                        "over every cell in use (docs/llamacpp.md)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="GGUF: a reply is what it gives alone, whatever runs beside it (exact on f32/q8_0: docs/llamacpp.md)")
    p.add_argument("--max-body-bytes", type=_size, default=8 << 20, help="largest request body accepted (default 8MiB)")
    p.add_argument("--max-string-length", type=int, default=None,
                   help="bound JSON strings without maxLength in structured outputs (default: unbounded)")
    p.add_argument("--reasoning", action="store_true",
                   help="a reasoning model: replies think first (<think>...</think>), then answer; requests may turn it off")
    p.add_argument("--json-bounds", default="default", choices=["default", "small", "none"],
                   help="bounds on structured outputs where the schema sets none (default: numbers within int64; "
                        "small: also strings, arrays and objects, for small models)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="replies waiting for room in the model's KV pool before a new request gets 503 with Retry-After "
                        "(default 256; 0: refuse whenever replies already wait)")
    p.add_argument("--speculate", default="none", choices=["none", "lookup"],
                   help="speculative decoding of text and JSON replies: 'lookup' drafts from each conversation's own "
                        "tokens and verifies the drafts in the step's one forward (same tokens when greedy; "
                        "docs/speculation.md). Default none")
    p.add_argument("--timeout-keep-alive", type=_seconds, default=KEEP_ALIVE_S, metavar="SECONDS",
                   help=f"how long an idle client connection stays open (default {KEEP_ALIVE_S}: longer than the "
                        "clients' own pools keep one, httpx's and OpenAI's 5 s, so a client never sends on a "
                        "connection the server has just closed)")
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    native = _preload(args)  # a GGUF loads on its own thread (llama.cpp's C code) while the imports below run
    import importlib.util

    if importlib.util.find_spec("uvicorn") is None or importlib.util.find_spec("fastapi") is None:
        print("continuum serve needs the serve extra: pip install 'continuum[serve]'", file=sys.stderr)
        return 2
    if args.max_queue < 0:
        print(f"continuum serve: --max-queue must be >= 0, got {args.max_queue}", file=sys.stderr)
        return 2
    from .redact import install_log_redaction

    install_log_redaction()  # before any logger runs: a store URL's password never reaches a log line
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    template = None
    if args.chat_template is not None:
        template = Path(args.chat_template).read_text()
    if native is not None:  # listen now; torch, FastAPI and the engine load behind it (serve/starting.py)
        from ..models.llamacpp.model import check_gguf  # (no torch: a missing file is said before listening)

        try:
            check_gguf(args.model)
        except ValueError as exc:
            _say(exc)
            return 2
        return _serve_while_building(args, native, template)
    try:
        app = _build(args, template, native)
    except _StartError as exc:  # a bad option, a store that cannot open: a line that says what to do, no traceback
        _say(exc.__cause__)
        return 2
    import uvicorn

    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                    timeout_keep_alive=args.timeout_keep_alive)
    finally:
        app.state.ctx.close()  # (the retention thread stops; idempotent after the app's own lifespan did it)
    return 0


def _say(what: object) -> None:
    """The one line a failed start prints (a store's URL in it with its password masked)."""
    from .redact import redact

    print(f"continuum serve: {redact(what)}", file=sys.stderr)


class _StartError(Exception):
    """A failure to start that is the user's to fix (its ``__cause__`` says how): reported in one line."""


def _build(args: argparse.Namespace, template: str | None, native: _Preload | None):
    """The app: the model loaded (``native``'s when preloaded), its store opened. Raises :class:`_StartError`."""
    from ..errors import ReasoningError
    from .app import ServeConfig, create_app
    from .errors import StoreUnavailable
    from .redact import redact
    from .store import StoreLockedError

    try:
        model = _load(args, native)
    except ValueError as exc:  # ModelLoadError, bad options
        raise _StartError() from exc
    name = args.served_model_name or Path(args.model.rstrip("/")).name
    config = ServeConfig(served_model_name=name, store=_store_location(args.store), api_keys=args.api_keys,
                         template=template, state_memory_bytes=args.state_memory or 0, retention_age=args.retention_age,
                         retention_bytes=args.retention_bytes, retention_interval=args.retention_interval,
                         max_body_bytes=args.max_body_bytes or (8 << 20),
                         max_string_length=args.max_string_length, reasoning=args.reasoning,
                         store_kv=args.store_kv == "full", json_bounds=args.json_bounds, max_queue=args.max_queue,
                         speculate=None if args.speculate == "none" else args.speculate)
    try:
        app = create_app(model, config)
    except (StoreLockedError, StoreUnavailable, ReasoningError) as exc:  # (a database down at start: say so, exit)
        raise _StartError() from exc
    if not args.api_keys:
        logger.warning("no --api-key given: the server accepts every request without authentication, and every "
                       "stored response is readable by anyone who can reach %s:%s", args.host, args.port)
    # (redacted here as well as by the log records' factory: this line is the one that names the store)
    logger.info("serving %s as %r on http://%s:%s/v1 (store: %s)", args.model, name, args.host, args.port,
                redact(config.store))
    # What the start built (torch, transformers, the model, the app: ~400k objects) lives as long as the server. Frozen,
    # it is out of the collector's reach, so a full collection walks only what serving made since (vLLM does the
    # same): over all of it, one took 150-290 ms on 2 cores, a pause of every request in flight.
    gc.collect()
    gc.freeze()
    return app


def _serve_while_building(args: argparse.Namespace, native: _Preload, template: str | None) -> int:
    """uvicorn listens at once; the app is built on a thread (B21s: ready without waiting for torch's import)."""
    import uvicorn

    from .starting import Starting

    status = 0

    def failed(exc: BaseException) -> None:
        nonlocal status
        if isinstance(exc, _StartError):
            _say(exc.__cause__)
            status = 2
        else:
            logger.error("continuum serve could not start", exc_info=exc)
            status = 1
        server.should_exit = True

    def build():
        # after the weights: on 2 cores torch's import beside llama.cpp's load slows both (B21s), and a server whose
        # weights are loaded answers /health 200 and accepts requests while the import runs
        native.join()
        return _build(args, template, native)

    app = Starting(build, loaded=native.loaded, failed=failed, stopping=lambda built: built.state.ctx.close())
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5, timeout_keep_alive=args.timeout_keep_alive))
    try:
        server.run()
    finally:
        if app.app is not None:  # (the built app gets no lifespan behind Starting: its retention thread stops here)
            app.app.state.ctx.close()
    return status


class _Preload(threading.Thread):
    """``LlamaCppModel(path, ...)`` on a thread: the weights' load and the context's allocation are llama.cpp's C
    code, which runs beside the imports of torch and FastAPI on the main thread (measured: B21s in
    docs/benchmarks.md). Its own modules import neither torch nor transformers."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(name="continuum-preload", daemon=True)
        self.args = args
        self.model: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            from ..models.llamacpp.model import LlamaCppModel

            a = self.args
            self.model = LlamaCppModel(a.model, n_ctx=a.n_ctx, n_threads=a.threads, batch_invariant=a.batch_invariant)
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread, where it is reported
            self.error = exc

    def loaded(self) -> bool:
        """The weights are in memory and the context allocated."""
        return self.model is not None

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.model


def _idle_cells(text: str) -> int | str | None:
    if text in ("default", "none"):
        return None if text == "none" else text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"--idle-cells takes a number of cells >= 0, or 'none' (got {text!r})")
    return value


def _gguf_options(args: argparse.Namespace) -> dict:
    return {} if args.idle_cells == "default" else {"idle_cells": args.idle_cells}


def _preload(args: argparse.Namespace) -> _Preload | None:
    if not args.model.lower().endswith(".gguf") or args.dtype is not None or args.device is not None:
        return None  # (transformers; or options a GGUF refuses: _load says so)
    return _Preload(args)


def _load(args: argparse.Namespace, native: _Preload | None = None):
    """The model: a ``.gguf`` file on llama.cpp (``models.llamacpp``; loaded by ``native`` when it was started),
    anything else on transformers."""
    from .. import models
    from ..errors import ModelLoadError

    gguf = args.model.lower().endswith(".gguf")
    if not gguf:
        if args.n_ctx is not None or args.threads is not None or args.batch_invariant or args.idle_cells != "default":
            raise ModelLoadError("--n-ctx, --threads, --idle-cells and --batch-invariant are llama.cpp options: serve a "
                                 ".gguf file")
        return models.transformers(args.model, device=args.device, dtype=args.dtype, prefix_cache=args.prefix_cache)
    for flag, value in (("--dtype", args.dtype), ("--device", args.device)):
        if value is not None:
            raise ModelLoadError(f"{flag} is not available for a GGUF on llama.cpp (its weights' type is the file's, "
                                 f"and it runs on the CPU): leave it out")
    if native is not None:
        return models.llamacpp(native.result(), prefix_cache=args.prefix_cache, **_gguf_options(args))
    return models.llamacpp(args.model, n_ctx=args.n_ctx, n_threads=args.threads, batch_invariant=args.batch_invariant,
                           prefix_cache=args.prefix_cache, **_gguf_options(args))


if __name__ == "__main__":
    sys.exit(main())
