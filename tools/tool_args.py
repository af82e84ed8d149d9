"""Arguments of the tools checked before any work starts: a bad one ends with one ``error:`` line, no traceback.

Numbers and lists of numbers are checked as argparse parses them (``type=``): a bad one gets
argparse's own usage error (exit 2) naming the argument and what to give. Paths are checked right
after parsing (:func:`out_folder`, :func:`out_file`, :func:`in_file`), before a tool spends minutes
on work whose result it could not write, or reads a file it cannot, and without creating anything:
each raises ``SystemExit`` with one line naming the argument.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def count(low: int, example: str, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low`` and <= ``high`` (``example`` is shown when it is not)."""
    bound = f">= {low}" if high is None else f"from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number; give one {bound}, e.g. {example}"
            ) from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range; give a whole number {bound}, e.g. {example}")
        return value

    return parse


def number(low: float, example: str, above: bool = True, high: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number above ``low`` (or at least it, ``above=False``) and at most ``high``."""
    bound = f"> {low:g}" if above else f">= {low:g}"
    if high < math.inf:
        bound += f" and <= {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one {bound}, e.g. {example}") from None
        if not math.isfinite(value) or value < low or (above and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; give a number {bound}, e.g. {example}")
        return value

    return parse


def listed(item: Callable[[str], T], example: str, unique: bool = True) -> Callable[[str], list[T]]:
    """An argparse type: comma-separated values, each checked by ``item``; none empty, none twice (``unique``)."""

    def parse(text: str) -> list[T]:
        parts = [part.strip() for part in text.split(",")]
        if not any(parts):
            raise argparse.ArgumentTypeError(f"{text!r} lists nothing; give comma-separated values, e.g. {example}")
        if not all(parts):
            raise argparse.ArgumentTypeError(f"{text!r} has an empty item; give comma-separated values, e.g. {example}")
        values = []
        for part in parts:
            try:
                values.append(item(part))
            except argparse.ArgumentTypeError as err:
                raise argparse.ArgumentTypeError(f"in {text!r}: {err}") from None
        if unique and len(set(values)) < len(values):
            raise argparse.ArgumentTypeError(f"{text!r} gives a value twice; give each once, e.g. {example}")
        return values

    return parse


def counts(low: int, example: str) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated whole numbers >= ``low``, each once (``example``: such a list)."""
    return listed(count(low, example.split(",")[0]), example)


def int_kwargs(text: str) -> dict[str, int]:
    """An argparse type: a model's keyword arguments as ``k=v,k=v`` with whole-number values ("": none)."""
    out: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        key, _, value = (side.strip() for side in item.partition("="))
        if not key or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(
                f"{item!r} is not key=whole number; give k=v,k=v, e.g. patch_size=7,dim=64"
            )
        out[key] = int(value)
    return out


def out_folder(path: Path, arg: str) -> None:
    """Check, creating nothing, that the tool can make ``path`` (a folder it writes into) or write into it.

    The nearest existing folder on the way to ``path`` (``path`` itself if it exists) must be a folder this
    process may write to, as for a run's ``out_dir``.

    Raises:
        SystemExit: One ``error:`` line naming ``arg``: ``path`` is a file, lies under one, or is not writable.
    """
    if path.exists() and not path.is_dir():
        raise SystemExit(f"error: {arg} {path}: is a file, not a folder; give a folder (created if missing)")
    _writable_on_the_way(path, arg)


def out_file(path: Path, arg: str) -> None:
    """Check, creating nothing, that ``path`` can be written later (its folder is created then if missing).

    Raises:
        SystemExit: One ``error:`` line naming ``arg``: a folder, under a file, or not writable.
    """
    if path.is_dir():
        raise SystemExit(f"error: {arg} {path}: is a folder; give a file name to write")
    if path.exists() and not os.access(path, os.W_OK):
        raise SystemExit(f"error: {arg} {path}: is not writable; give a file you can write")
    _writable_on_the_way(path.absolute().parent, arg, path)


def _writable_on_the_way(folder: Path, arg: str, given: Path | None = None) -> None:
    """The nearest existing folder on the way to ``folder`` must be one this process may write to."""
    nearest = folder.absolute()
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    shown = given or folder
    if not nearest.is_dir():
        raise SystemExit(f"error: {arg} {shown}: lies under {nearest}, a file, not a folder; give another path")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise SystemExit(f"error: {arg} {shown}: {nearest} is not writable; give a path you can write to")


def in_file(path: Path, arg: str, what: str) -> None:
    """Check that ``path`` is a file this process can read (``what``: which file to give instead).

    Raises:
        SystemExit: One ``error:`` line naming ``arg``: missing, a folder, or unreadable.
    """
    if not path.exists():
        raise SystemExit(f"error: {arg} {path}: does not exist; give {what}")
    if not path.is_file():
        raise SystemExit(f"error: {arg} {path}: is not a file; give {what}")
    if not os.access(path, os.R_OK):
        raise SystemExit(f"error: {arg} {path}: is not readable; give {what} you can read")
