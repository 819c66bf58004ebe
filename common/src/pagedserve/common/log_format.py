"""The log-format setting, apart from pagedserve.common.log so that a parser that offers the
flag does not import structlog (`--help` stays light)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.common.settings import setting

LOG_FORMATS = ("auto", "console", "json")


@dataclass(frozen=True)
class LoggingConfig:
    """How a server process writes its log lines (the flag of `serve`, `controlplane` and
    `dataplane`)."""

    log_format: str | None = setting(
        None,
        "log lines on stderr: console (readable) or json (one object a line, for a collector); "
        "auto: console on a terminal, else json; the processes it starts log the same way "
        "(default: $PAGEDSERVE_LOG_FORMAT, else auto)",
        choices=LOG_FORMATS,
    )
