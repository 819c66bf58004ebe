"""The store's errors, apart so that the store and the GGUF folders both raise them."""


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that resolves to nothing usable; the message says how to fix it."""
