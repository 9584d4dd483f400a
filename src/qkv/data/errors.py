"""The error type for bad user data: the command prints its one-line message and exits 2."""


class DataError(ValueError):
    """A data file or folder the user named cannot be used (missing, empty, malformed)."""
