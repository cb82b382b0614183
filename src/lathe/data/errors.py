"""The one error type of ``lathe.data`` (a leaf, so that every data module can raise it without importing another)."""


class DataError(ValueError):
    """A data file or row that cannot be used; the message names where and how to fix it."""
