"""The one error type for conversions a user can get wrong (bad path, wrong or damaged file)."""


class ConversionError(ValueError):
    """A source file cannot be converted; the message names the file and what was expected vs found.

    A `ValueError` subclass so callers (the CLI, tests) can treat it like any other bad-input error,
    while internal bugs still surface as ordinary tracebacks.
    """
