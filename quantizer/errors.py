"""Errors the user can act on. The core raises them; the CLI prints their message as one line."""


class Int4qError(Exception):
    """Base class: the message is one line that says what is wrong and, where it can, what to do."""


class InputError(Int4qError):
    """The input checkpoint, text or option values cannot be used."""


class UnsupportedError(Int4qError):
    """A checkpoint asks for something this version cannot do."""
