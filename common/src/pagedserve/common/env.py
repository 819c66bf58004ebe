"""Every environment variable pagedserve reads, typed and prefixed, read only when asked."""

from __future__ import annotations

import os
from pathlib import Path

# What `model_home()` resolves to, for the `--model-home` flags' help.
MODEL_HOME_HELP = (
    "model store directory (default: $PAGEDSERVE_MODEL_HOME, else $XDG_CACHE_HOME/pagedserve/models, "
    "else ~/.cache/pagedserve/models)"
)


def model_home() -> Path:
    """Root of the local model store: $PAGEDSERVE_MODEL_HOME, else $XDG_CACHE_HOME/pagedserve/models."""
    explicit = os.environ.get("PAGEDSERVE_MODEL_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "pagedserve" / "models"


def log_level() -> str:
    """$PAGEDSERVE_LOG_LEVEL (default INFO)."""
    return os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO").upper()


def log_format() -> str:
    """$PAGEDSERVE_LOG_FORMAT: auto, console or json (default auto; `--log-format` sets it for
    the process and its children)."""
    return os.environ.get("PAGEDSERVE_LOG_FORMAT", "auto").lower()
