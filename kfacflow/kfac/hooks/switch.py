"""The factor hooks' registrations, taken off the modules on the steps that make no factors.

At ``kfac.factor_update_freq=10`` nine steps in ten make no factors, and a hook that only returns
still costs its call: PyTorch runs a module with hooks on the slow path of ``Module.__call__``, and
each call of each hooked layer pays a Python function call or two (about 0.1-0.3 ms a step on the
small ViT's 18 layers, hooks of the side blocks besides). So the hooks live here, keyed by their
owner, and are registered only while the step makes factors: a step without factors runs the model
as if K-FAC were not there. A hook registered again goes last among the module's hooks; K-FAC's own
hooks read their inputs and never change them, so their order does not matter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

PreHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]
PostHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]


class FactorHooks:
    """Forward (pre-)hooks with kwargs, registered while :attr:`on`, removed while off."""

    def __init__(self) -> None:
        self._wanted: dict[str, list[tuple[nn.Module, PreHook | None, PostHook | None]]] = {}
        self._handles: dict[str, list[RemovableHandle]] = {}
        self.on = True
        self._gone = False

    def add(self, key: str, module: nn.Module, pre: PreHook | None = None, post: PostHook | None = None) -> None:
        """Hook ``module`` under ``key`` (its owner's name for it): ``pre`` before each call, ``post`` after."""
        self._wanted.setdefault(key, []).append((module, pre, post))
        if self.on and not self._gone:
            self._handles.setdefault(key, []).extend(_register(module, pre, post))

    def switch(self, on: bool) -> None:
        """Register every hook (``on``) or take every one off; nothing after :meth:`remove`."""
        if on == self.on or self._gone:
            self.on = on
            return
        self.on = on
        if not on:
            self._take_off(list(self._handles))
            return
        for key, wanted in self._wanted.items():
            self._handles[key] = [h for module, pre, post in wanted for h in _register(module, pre, post)]

    def drop(self, keys: set[str]) -> None:
        """Forget the hooks of ``keys`` for good."""
        self._take_off([key for key in keys if key in self._handles])
        for key in keys:
            self._wanted.pop(key, None)

    def remove(self, keys: set[str] | None = None) -> None:
        """Forget the hooks of ``keys`` (default: all, and never register any again)."""
        if keys is None:
            self._gone = True
            keys = set(self._wanted)
        self.drop(keys)

    def registered(self) -> int:
        """How many hooks are on the modules now."""
        return sum(len(handles) for handles in self._handles.values())

    def _take_off(self, keys: list[str]) -> None:
        for key in keys:
            for handle in self._handles.pop(key, []):
                handle.remove()


def _register(module: nn.Module, pre: PreHook | None, post: PostHook | None) -> list[RemovableHandle]:
    handles = []
    if pre is not None:
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    if post is not None:
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles
