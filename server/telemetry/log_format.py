"""The process's log lines: readable text, or one JSON object per line (`--log-format json`)."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

from hotlora.config.log_text import printable
from hotlora.config.settings import Settings

TEXT_FORMAT = "%(levelname)s:     %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT`, each line's message passed through `printable` (a traceback, added after
    it, keeps its lines): whatever a log call forgot to escape cannot forge a line either."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", ...}`, plus the record's `fields` as keys (an
    access line's request facts, a start-up phase's duration)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def configure_logging(settings: Settings) -> None:
    """Send every log line to stderr at `settings.log_level`, formatted as `log_format` says."""
    level = "DEBUG" if settings.log_level == "trace" else settings.log_level.upper()
    handler = logging.StreamHandler()
    json_lines = settings.log_format == "json"
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])


def uvicorn_logging(settings: Settings) -> dict[str, Any]:
    """uvicorn's logging options: in JSON, its loggers keep no handlers of their own and reach
    the JSON handler through the root logger."""
    return {"log_config": None} if settings.log_format == "json" else {}
