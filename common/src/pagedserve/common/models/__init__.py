"""The local model store: `pagedserve models pull|list` and name -> folder resolution."""

from pagedserve.common.models.store import (
    DEFAULT_MODEL,
    REGISTRY,
    ModelInfo,
    ModelNotFoundError,
    PullError,
    RegistryEntry,
    is_complete,
    known_models,
    list_models,
    pull_model,
    resolve_model_path,
    store_dir,
)

__all__ = [
    "DEFAULT_MODEL",
    "REGISTRY",
    "ModelInfo",
    "ModelNotFoundError",
    "PullError",
    "RegistryEntry",
    "is_complete",
    "known_models",
    "list_models",
    "pull_model",
    "resolve_model_path",
    "store_dir",
]
