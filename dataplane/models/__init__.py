"""The local model store: `pagedserve models pull|list` and name -> folder resolution."""

from dataplane.models.store import (
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
