"""Errors that reach a user: one line that names the key or file and says what was expected."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user gave us (recipe, flags, files); the CLI prints it as one line, exit code 2."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # one line, whatever the parts contained


class RecipeError(UserError):
    """A recipe that cannot be loaded or validated."""


def raise_first_problem(problems: list[tuple[str, str]]) -> None:
    """Raise RecipeError for the first (key, message) problem, counting and naming the others; none: return."""
    if not problems:
        return
    (key, message), rest = problems[0], problems[1:]
    more = f" (and {len(rest)} more: {', '.join(k for k, _ in rest)})" if rest else ""
    # a message that already begins with its key (the parallel sizes' do) is not prefixed twice
    raise RecipeError(f"{message if message.startswith(key) else f'{key}: {message}'}{more}")


class RecipeValueError(ValueError):
    """A ValueError raised by a schema validator that names the keys it is about (dotted, relative to the
    validating section), so the loader can say in which file or flag each was set."""

    def __init__(self, message: str, *keys: str) -> None:
        super().__init__(message)
        self.keys = keys
