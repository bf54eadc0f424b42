"""Secrets out of what the server prints: a store URL's password never reaches a log line, an error message or a
response body (``continuum serve --store postgresql://user:PASSWORD@host/db``).

:func:`redact` masks the password of every URL with userinfo (``scheme://user:PASSWORD@``) and of every libpq
``password=...`` setting (a key=value DSN, or a URL's query parameter). :func:`install_log_redaction` applies it
to every log record of the process (uvicorn's, psycopg's pool, ours), message and traceback, because a driver's
error may echo the connection string it was given (libpq's "missing '=' after ..." does).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import traceback
from typing import Any

__all__ = ["MASK", "install_log_redaction", "redact"]

MASK = "***"
# userinfo with a password: the password runs to the '@' (a raw '/' or ':' in it is still masked; over-masking a
# non-URL that looks like one is harmless), never across whitespace or a quote, which end a URL in a log line
_URL = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@'\"]*:)(?P<secret>[^@\s'\"]+)(?=@)")
# password=... in a libpq DSN ('quoted', backslash escapes) or in a URL's query (up to '&')
_KEY = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<secret>'(?:[^'\\]|\\.)*'|[^\s&'\"]+)", re.IGNORECASE)


def redact(text: Any) -> str:
    """``str(text)`` with every password in it masked (:data:`MASK`)."""
    out = str(text)
    if "password" not in out.lower() and "://" not in out:
        return out  # (the common case: nothing to scan)
    out = _URL.sub(lambda m: m.group("head") + MASK, out)
    return _KEY.sub(lambda m: m.group("head") + MASK, out)


_installed = False


def install_log_redaction() -> None:
    """Every log record created from now on is redacted: its message (formatted once, here) and its traceback
    (rendered here into ``exc_text``, which formatters print instead of formatting the exception again). A record
    factory rather than a handler's filter: uvicorn's loggers have handlers of their own, configured later. An
    exception nobody catches (on the main thread or another) is printed redacted too."""
    global _installed
    if _installed:
        return
    _installed = True
    make = logging.getLogRecordFactory()
    formatter = logging.Formatter()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the logging module's to report, as it would
            return record
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
            record.exc_text = redact(formatter.formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return record

    logging.setLogRecordFactory(factory)

    def uncaught(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        sys.stderr.write(redact("".join(traceback.format_exception(kind, exc, tb))))

    def uncaught_in_thread(args: Any) -> None:
        if args.exc_type is not SystemExit:
            where = f"Exception in thread {args.thread.name if args.thread else '?'}:\n"
            sys.stderr.write(where + redact("".join(traceback.format_exception(args.exc_type, args.exc_value,
                                                                                args.exc_traceback))))

    sys.excepthook = uncaught
    threading.excepthook = uncaught_in_thread
