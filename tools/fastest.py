"""The fastest of a few runs of a small piece of work: what the tools that time kernels on one thread compare."""

from __future__ import annotations

import time
from collections.abc import Callable


def fastest(fn: Callable[[], object], reps: int, untimed: int = 0) -> float:
    """The least wall time, in seconds, of ``reps`` calls of ``fn`` after ``untimed`` calls that are not timed."""
    for _ in range(untimed):
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
