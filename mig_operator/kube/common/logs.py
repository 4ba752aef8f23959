"""Structured, quiet logging for the controller and the agents.

``text``: one line per record, ``time level logger: message``. ``json``: one JSON object per line
(``time``, ``level``, ``logger``, ``message``, and ``error`` with the exception when there is one).
kopf's own loggers are held at WARNING unless the level asked for is DEBUG: it logs every event.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

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


def configure(log_format: str = "text", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    numeric = getattr(logging, level.upper())
    root.setLevel(numeric)
    kopf_level = logging.DEBUG if numeric <= logging.DEBUG else logging.WARNING
    for name in ("kopf", "aiohttp", "asyncio", "kubernetes"):
        logging.getLogger(name).setLevel(max(kopf_level, numeric))
