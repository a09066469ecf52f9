"""The error a user sees when a model cannot be found, fetched or loaded."""


class LoadError(ValueError):
    """A checkpoint cannot be loaded; the message says why and where."""
