"""The one exception type for mistakes a user can fix: bad recipes, missing data, bad world size."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """A problem the user can fix; printed as one line and the process exits with code 2."""

    exit_code = 2


class TrainingError(UserError):
    """Training cannot go on (e.g. non-finite losses step after step); printed as one line, exit code 3."""

    exit_code = 3


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """Return a ``did you mean 'x'?`` hint for ``name``, or an empty string if nothing is close.

    Args:
        name: The misspelled name.
        choices: The valid names.

    Returns:
        A short hint starting with a space, or ``""``.
    """
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"
