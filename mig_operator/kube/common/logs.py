"""Structured, quiet logging for the controller and the agents.

``text``: one line per record, ``time level logger: message``. ``json``: one JSON object per line
(``time``, ``level``, ``logger``, ``message``, and ``error`` with the exception when there is one).
kopf's own loggers are held at WARNING unless the level asked for is DEBUG: it logs every event.

With ``json`` nothing else reaches stderr as plain text either: Python warnings become records of the
``py.warnings`` logger, an exception that ends the process becomes one record with its traceback in
``error``, and any other line written to stderr (the command line's one-line start-up errors, such as
``mig-operator: initialise NVML: ...``) becomes a record of the ``stderr`` logger.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from datetime import UTC, datetime
from types import TracebackType
from typing import TextIO

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace(
                "+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class JsonLines(io.TextIOBase):
    """A text stream that writes each complete line as one JSON record of ``logger``; a partial line
    waits for its end or for ``flush``."""

    def __init__(self, target: TextIO, logger: str = "stderr", level: str = "error") -> None:
        self._target, self._logger, self._level = target, logger, level
        self._pending = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
            for line in lines:
                self._emit(line)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._emit(self._pending)
                self._pending = ""
            self._target.flush()

    def _emit(self, line: str) -> None:
        if not line.strip():
            return
        record = logging.LogRecord(self._logger, logging.getLevelName(self._level.upper()), "", 0, line, None, None)
        self._target.write(JsonFormatter().format(record) + "\n")


def _log_uncaught(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("mig_operator").critical("stopped by an unexpected error: %s", value or kind.__name__,
                                               exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is not None:
        logging.getLogger("mig_operator").error(
            "thread %s stopped by an unexpected error: %s", getattr(args.thread, "name", "?"), args.exc_value,
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def configure(log_format: str = "text", level: str = "info") -> None:
    stream = sys.stderr._target if isinstance(sys.stderr, JsonLines) else sys.stderr
    handler = logging.StreamHandler(stream)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread
        if not isinstance(sys.stderr, JsonLines):
            sys.stderr = JsonLines(sys.stderr)
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.captureWarnings(True)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    numeric = getattr(logging, level.upper())
    root.setLevel(numeric)
    kopf_level = logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING
    for name in ("kopf", "aiohttp", "asyncio", "kubernetes"):
        logging.getLogger(name).setLevel(max(kopf_level, numeric))
