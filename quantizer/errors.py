"""Errors the user can act on. The core raises them; the CLI prints their message as one line."""


class Int4qError(Exception):
    """Base class: the message is one line that says what is wrong and, where it can, what to do."""


class InputError(Int4qError):
    """The input checkpoint, text or option values cannot be used."""


class UnsupportedError(Int4qError):
    """A checkpoint asks for something this version cannot do."""


class UsageError(InputError):
    """Options that do not go together, or do not apply here; the CLI exits 2, as for bad usage."""


class InterruptedRun(Int4qError):
    """A run stopped by ``cause`` (an error, a signal, Ctrl-C) after keeping work that a rerun can
    continue from; ``kept`` says where, as a clause to append to the cause's message."""

    def __init__(self, cause: BaseException, kept: str):
        super().__init__(f"{cause}{kept}")
        self.cause, self.kept = cause, kept
