"""kfacflow: recipe-driven distributed training with K-FAC (D-KFAC, MPD-KFAC, SPD-KFAC).

The package root holds only the version and the exceptions every layer raises, so that importing
any module (the schema, the registries) loads nothing else of the project.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``kfacflow.KFACPreconditioner`` and ``kfacflow.muon``, the library API, imported on first use (a leaf root)."""
    if name == "KFACPreconditioner":
        from kfacflow.library import KFACPreconditioner

        return KFACPreconditioner
    if name == "muon":
        from kfacflow.library_muon import muon

        return muon
    raise AttributeError(f"module 'kfacflow' has no attribute {name!r}")


class UserError(Exception):
    """A problem the user can fix; printed as one line and the process exits with code 2.

    A DataLoader worker process's exception comes back as the same type built from a text that
    starts ``Caught UserError in DataLoader worker process N.`` and goes on with the worker's
    traceback; the message is then the original line again (the last line of that traceback).
    """

    exit_code = 2
    local = False
    """Whether only the raising rank knows it (it prints the line); else every rank raises it and rank 0 prints."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (_unwrap_worker_message(args[0], type(self).__name__),)
        super().__init__(*args)


def _unwrap_worker_message(text: str, name: str) -> str:
    """Return the original message if ``text`` is torch's re-raise of a worker's ``name`` exception."""
    if not (text.startswith(f"Caught {name} in ") and "\nOriginal Traceback" in text):
        return text
    lines = [line for line in text.splitlines() if line.strip()]
    match = re.match(rf"(?:[\w.]+\.)?{re.escape(name)}: (.*)$", lines[-1])
    return match.group(1) if match else text


class TrainingError(UserError):
    """Training cannot go on (e.g. non-finite losses step after step); printed as one line, exit code 3."""

    exit_code = 3


class StorageError(UserError):
    """The run folder cannot be written (disk full, permissions); printed as one line, exit code 4.

    Raised on every rank together (the writer tells the others), so nothing is left half done.
    """

    exit_code = 4


class DataError(UserError):
    """A sample cannot be read (a corrupt file); found by the one rank that reads it, which prints it."""

    local = True


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
