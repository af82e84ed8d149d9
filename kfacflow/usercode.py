"""The user's own code in a run: the ``module.path:factory`` that ``model.name`` or ``data.name`` names.

A call that does not fit the factory's parameters is the user's mistake, in one line; an exception
raised inside the user's code is a bug of theirs: it keeps its traceback, and the line names the key.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable
from typing import Any

from kfacflow import UserError


class UserCodeError(UserError):
    """The user's own code (a ``module.path:factory`` or its dataset) raised; its traceback is the user's to read.

    The line names the recipe key; whoever prints the line prints the traceback of ``__cause__`` above it.
    """

    def print_cause(self) -> None:
        """Print the traceback of the user's exception to stderr (the ``error:`` line follows)."""
        if self.__cause__ is not None:
            traceback.print_exception(self.__cause__)


def first_line(err: BaseException) -> str:
    """Return ``Type: the first line of the message`` of ``err``."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def call_factory(key: str, name: str, factory: Callable[..., Any], signature: str, *args: Any) -> Any:
    """Call the user's ``module.path:factory`` that the recipe key ``key`` names.

    Args:
        key: ``model.name`` or ``data.name``.
        name: Its value.
        factory: What the registry imported.
        signature: How kfacflow calls it, e.g. ``factory(num_classes, in_channels)``.
        *args: The arguments.

    Returns:
        What the factory returned.

    Raises:
        UserError: The factory cannot be called with ``args`` (its parameters differ).
        UserCodeError: The factory raised: a bug of the user's code, printed with its traceback.
    """
    try:
        params: inspect.Signature | None = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself tells
        params = None
    if params is not None:
        try:
            params.bind(*args)
        except TypeError as err:
            raise UserError(
                f"{key}={name!r} is called as {signature}, which {name.partition(':')[2]}{params} cannot take "
                f"({err}); give it those parameters."
            ) from None
    try:
        return factory(*args)
    except UserError:
        raise
    except Exception as err:
        raise UserCodeError(f"{key}={name!r} raised {first_line(err)} (its traceback is above); fix it.") from err
