"""Operations, in process (issue 56): a store URL's password is masked wherever text leaves the server (log lines,
their tracebacks, error bodies), and a reply's time to first token counts from its request's arrival, through the
worker threads that generate it. The real servers' side (their logs, /ready, /metrics, retention on PostgreSQL) is
in tests/test_serve_postgres.py."""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("fastapi")

from continuum.serve.redact import MASK, install_log_redaction, redact

SECRET = "S3cretPW"


@pytest.mark.parametrize("text", [
    f"serving m on http://127.0.0.1:8000/v1 (store: postgresql://postgres:{SECRET}@db:5432/continuum)",
    f"postgres://u:{SECRET}@/postgres?host=/tmp/pg",
    f"postgresql://u:p/{SECRET}:x@h/db",  # an unencoded '/' or ':' in the password
    f"host=db user=u password={SECRET} dbname=x",
    f"host=db password='{SECRET} with spaces' dbname=x",
    f"postgresql://db/x?user=u&password={SECRET}&sslmode=require",
    f'missing "=" after "postgresql://u:{SECRET}@h:x" in connection info string',  # libpq quoting what it was given
])
def test_passwords_are_masked(text):
    out = redact(text)
    assert SECRET not in out and MASK in out


def test_what_is_not_a_secret_is_left_alone():
    for text in ["serving m on http://127.0.0.1:8000/v1", "postgresql://postgres:@/postgres?host=/tmp/x",
                 "postgresql://user@db/x", "GET /v1/responses/resp_1 HTTP/1.1 200"]:
        assert redact(text) == text


@pytest.fixture
def redacting(monkeypatch):
    """The process-wide hooks installed for the test, and put back after it (pytest has hooks of its own)."""
    import sys
    import threading

    from continuum.serve import redact as module

    factory = logging.getLogRecordFactory()
    monkeypatch.setattr(module, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    install_log_redaction()
    yield
    logging.setLogRecordFactory(factory)


def test_log_records_are_redacted_message_and_traceback(redacting):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("continuum.test.redact")
    log.addHandler(handler)
    try:
        log.warning("store: %s", f"postgresql://u:{SECRET}@db/x")
        try:
            raise RuntimeError(f"connection to postgresql://u:{SECRET}@db/x failed")
        except RuntimeError:
            log.exception("could not start")
    finally:
        log.removeHandler(handler)
    text = "\n".join(logging.Formatter().format(r) for r in records)
    assert SECRET not in text and "postgresql://u:***@db/x" in text and "RuntimeError" in text


def test_error_bodies_are_redacted():
    from continuum.serve.errors import StoreUnavailable, from_exception

    error = from_exception(StoreUnavailable(f"the database postgresql://u:{SECRET}@db/x does not answer"))
    assert error.status == 503 and SECRET not in error.message and MASK in error.message


def test_time_to_first_token_counts_from_the_arrival_through_worker_threads():
    """A request arrives (``ARRIVAL``, set by the app's outermost middleware), waits, then generates on a worker
    thread (anyio's for a reply, serve/sse.py's for a stream): its TTFT includes the wait."""
    import anyio

    from continuum.serve.queue import ARRIVAL, ReplyQueue
    from continuum.serve.sse import ThreadStream

    queue = ReplyQueue(None, lambda: 0)
    seen = []
    queue.on_generation = seen.append

    def generate(emit=None, cancelled=None):
        with queue.generation() as g:
            g.token.first = time.perf_counter()  # (the engine marks it at the first token)

    async def request(streamed: bool):
        ARRIVAL.set(time.perf_counter())
        await anyio.sleep(0.2)  # waiting for a worker thread, for room in the KV pool...
        if streamed:
            stream = ThreadStream(generate)
            assert (await stream.get())[0] == "done"
        else:
            await anyio.to_thread.run_sync(generate)

    for streamed in (False, True):
        anyio.run(request, streamed)
    assert len(seen) == 2 and all(g.ttft is not None and g.ttft >= 0.2 for g in seen)


def test_an_uncaught_exception_is_printed_redacted():
    import subprocess
    import sys

    code = f"""
from continuum.serve.redact import install_log_redaction
import threading

install_log_redaction()

def fail():
    raise RuntimeError("postgresql://u:{SECRET}@db/x")

thread = threading.Thread(target=fail)
thread.start()
thread.join()
fail()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and SECRET not in out.stderr
    assert out.stderr.count("postgresql://u:***@db/x") == 2 and "Traceback" in out.stderr
