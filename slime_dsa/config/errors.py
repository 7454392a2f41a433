"""Errors that reach a user: one line that names the key or file and says what was expected."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user gave us (recipe, flags, files); the CLI prints it as one line, exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # one line, whatever the parts contained


class RecipeError(UserError):
    """A recipe that cannot be loaded or validated."""


class RecipeValueError(ValueError):
    """A ValueError raised by a schema validator that names the keys it is about (dotted, relative to the
    validating section), so the loader can say in which file or flag each was set."""

    def __init__(self, message: str, *keys: str) -> None:
        super().__init__(message)
        self.keys = keys
