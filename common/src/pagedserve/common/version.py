"""The release of every pagedserve distribution: they are versioned together, and each
pyproject.toml names this same version (tests/test_packaging.py checks it)."""

__version__ = "0.1.0"
