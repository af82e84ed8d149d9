"""Each whole inverse period's mean step of recorded runs, by the step timer (their ``timings.jsonl``).

    python tools/periods.py --every 10 out/bench/runs/*/run/*/

A period starts on an inverting step (1, I + 1, 2I + 1, ... at ``kfac.inv_update_freq`` I) and holds
I steps; a median or a window that is not whole periods hides or over-weights the inversions. The
first period, which holds the run's start-up, is left out unless ``--first 1``. One line a run: its
folder and each complete period's mean, in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def periods(steps: dict[int, float], every: int, first: int) -> list[float]:
    """The mean of each complete period of ``every`` steps from step ``first`` (steps numbered from 1)."""
    means = []
    start = first
    while all(s in steps for s in range(start, start + every)):
        means.append(sum(steps[s] for s in range(start, start + every)) / every)
        start += every
    return means


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/periods.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (each with its timings.jsonl)")
    parser.add_argument("--every", type=int, required=True, help="kfac.inv_update_freq of the runs")
    parser.add_argument("--first", type=int, default=None, help="the first period's first step (default every + 1)")
    args = parser.parse_args(argv)
    if args.every < 1:
        parser.error("--every must be at least 1")
    first = args.first if args.first is not None else args.every + 1
    for run in args.runs:
        log = run / "timings.jsonl"
        if not log.is_file():
            print(f"tools/periods.py: {run} has no timings.jsonl (give a run folder)", file=sys.stderr)
            return 2
        steps = {int(r["step"]): float(r["total"]) for r in map(json.loads, log.read_text().splitlines())}
        print(f"{run}  periods from step {first}: " + " ".join(f"{p:.3f}" for p in periods(steps, args.every, first)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
