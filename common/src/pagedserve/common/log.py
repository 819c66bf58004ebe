"""structlog set-up: readable console lines on a terminal, JSON lines (one object each) when
the log's stream, stderr, is not one, or as `--log-format` says."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import MutableMapping
from typing import Any

import structlog

from pagedserve.common import env
from pagedserve.common.log_format import LOG_FORMATS

_configured = False


def resolved_format(log_format: str) -> str:
    """console or json: `auto` decided by whether stderr is a terminal."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    if log_format == "auto":
        return "console" if sys.stderr.isatty() else "json"
    return log_format


def use_log_format(log_format: str) -> None:
    """Log in `log_format` from now on, in this process and the processes it starts (through
    $PAGEDSERVE_LOG_FORMAT, resolved here: a child whose stdout is a pipe to this process still
    logs as this one does, so a terminal never gets both kinds of line)."""
    global _configured
    os.environ["PAGEDSERVE_LOG_FORMAT"] = resolved_format(log_format)
    if _configured:
        _configured = False
        configure_logging()


class _StderrLogger:
    """Writes each line to whatever `sys.stderr` is at that moment (redirects and test capture work)."""

    def msg(self, message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


def _add_trace_ids(logger: Any, method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Every line logged inside a traced request carries its trace_id and span_id."""
    from pagedserve.common.telemetry import trace_ids

    for key, value in trace_ids().items():
        event.setdefault(key, value)
    return event


def configure_logging() -> None:
    global _configured
    if _configured:
        return
    fmt = env.log_format()
    tty = resolved_format(fmt if fmt in LOG_FORMATS else "auto") == "console"
    renderer: Any = structlog.dev.ConsoleRenderer() if tty else structlog.processors.JSONRenderer()
    # log.exception(...): in JSON the traceback is the line's "exception" field (the console
    # renderer prints it itself)
    tracebacks: list[Any] = [] if tty else [structlog.processors.format_exc_info]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            *tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(env.log_level())),
        logger_factory=lambda *args: _StderrLogger(),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(name: str) -> Any:
    configure_logging()
    return structlog.get_logger(name)


class StartupPhases:
    """Start-up in phases, each logged as it ends: `startup_phase` with the phase's name, its
    seconds and the seconds since the first phase began, so a slow start says where it spent
    its time (a first kernel build, a weight load from a slow disk, a long timing probe)."""

    def __init__(self, logger: Any) -> None:
        self._log = logger
        self._start = self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def done(self, phase: str, **fields: Any) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(now - self._last, 2)
        self._log.info(
            "startup_phase",
            phase=phase,
            seconds=self.seconds[phase],
            since_start_s=round(now - self._start, 2),
            **fields,
        )
        self._last = now

    @property
    def total_s(self) -> float:
        return round(time.perf_counter() - self._start, 2)
