"""A run's records over its whole life: what it adds up, whether it reached its target, and ``summary.json``.

A run may live in several processes (stopped, then resumed). Whatever ``summary.json`` or a
training row of the log adds up over the run's steps is kept here and travels in every
checkpoint, so that a resumed run's figures are the uninterrupted run's: the training loss of
the last epoch, the loss since the last training row, skipped steps, repaired tensors, the
training and wall seconds, the step times and the peak device memory.

``train.stop_at_accuracy`` (and ``train.stop_at_loss``) stops a run only when an evaluation reaches it
before the run's last step; reached at the last step, the run finished its budget, and ``summary.json``
says when the target was reached (``target_reached``) without calling it a stop (``stopped_at_accuracy``,
``stopped_at_loss``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kfacflow.timing import StepTimes


class RunRecords:
    """What the run has done so far, over every process of it.

    Args:
        train: The recipe's ``train`` section: its targets (``stop_at_accuracy``, ``stop_at_loss``; 0: none) and
            the timed steps the step-time figures leave out (``timing_warmup``).
        device: The training device (on CUDA its peak memory is recorded).
    """

    def __init__(self, train: Any, device: torch.device) -> None:
        self.target, self.loss_target, self.device = train.stop_at_accuracy, train.stop_at_loss, device
        self.history: list[dict[str, float]] = []
        self.interval = torch.zeros(3, dtype=torch.float64)
        """Loss sum, correct predictions and samples over every rank since the last training row."""
        self.epoch = torch.zeros(3, dtype=torch.float64)
        """The same over the current epoch; after its last step, over that epoch (``train_loss``)."""
        self.times = StepTimes(train.timing_warmup)
        self.skipped_steps = 0
        self.repaired = 0
        """Parameter tensors found to differ from rank 0's and restored (see kfacflow.running.consistency)."""
        self._peak: int | None = None
        """Peak device memory of earlier processes of the run (None on the CPU)."""
        self._seconds = 0.0
        """Training seconds of earlier processes, and of this one until ``_since``."""
        self._since: float | None = None
        """When this process's training resumed (None: not training now)."""
        self._wall = 0.0
        """Wall seconds of earlier processes' training loops."""
        self._wall_since: float | None = None

    # --- the clocks -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the clocks: the training loop of this process begins."""
        self._since = self._wall_since = time.perf_counter()

    @property
    def train_seconds(self) -> float:
        """Wall seconds spent training so far, over resumes; evaluations and checkpoints left out."""
        return self._seconds + (0.0 if self._since is None else time.perf_counter() - self._since)

    @property
    def wall_seconds(self) -> float:
        """Wall seconds of the run's training loops so far, over resumes (``summary.json``'s ``seconds``)."""
        return self._wall + (0.0 if self._wall_since is None else time.perf_counter() - self._wall_since)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the ``with`` body out of :attr:`train_seconds`."""
        seconds, self._since = self.train_seconds, None
        try:
            yield
        finally:
            self._seconds, self._since = seconds, time.perf_counter()

    @property
    def peak_memory(self) -> int | None:
        """The most device memory the run has held at once, over resumes (None on the CPU)."""
        if self.device.type != "cuda":
            return self._peak
        return max(self._peak or 0, torch.cuda.max_memory_allocated(self.device))

    # --- steps and evaluations --------------------------------------------------------------------

    def add(self, totals: torch.Tensor) -> None:
        """Count one step's loss sum, correct predictions and samples (over every rank)."""
        self.interval += totals
        self.epoch += totals

    def evaluated(self, step: int) -> bool:
        """Whether the validation set was evaluated after ``step``."""
        return any(record["step"] == step for record in self.history)

    @property
    def reached(self) -> dict[str, float] | None:
        """The first evaluation that reached every target set, or None (every rank holds the same history)."""
        if self.target <= 0 and self.loss_target <= 0:
            return None
        return next((record for record in self.history if self._meets(record)), None)

    def _meets(self, record: dict[str, float]) -> bool:
        acc = self.target <= 0 or record["val_acc"] >= self.target
        return acc and (self.loss_target <= 0 or record["val_loss"] <= self.loss_target)

    def when(self, record: dict[str, float]) -> dict[str, float]:
        """What ``target_reached`` says of ``record``: the targets, when, and the figures that reached them."""
        found = {"target": self.target, "val_acc": record["val_acc"]} if self.target > 0 else {}
        if self.loss_target > 0:
            found |= {"loss_target": self.loss_target, "val_loss": record["val_loss"]}
        return found | {k: record[k] for k in ("step", "epoch", "seconds")}

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return the checkpoint's part: ``history`` and ``train_seconds`` as before, the rest under ``records``."""
        return {
            "history": self.history,
            "train_seconds": self.train_seconds,
            "records": {
                "interval": self.interval.clone(),
                "epoch": self.epoch.clone(),
                "step_times": self.times.state_dict(),
                "skipped_steps": self.skipped_steps,
                "repaired_params": self.repaired,
                "wall_seconds": self.wall_seconds,
                "peak_memory": self.peak_memory,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint (one written before ``records`` were kept starts them here)."""
        self.history = list(state["history"])
        self._seconds = float(state.get("train_seconds", 0.0))
        records = state.get("records")
        if not records:
            return
        self.interval, self.epoch = records["interval"].double().clone(), records["epoch"].double().clone()
        self.times.load_state_dict(records["step_times"])
        self.skipped_steps, self.repaired = int(records["skipped_steps"]), int(records["repaired_params"])
        self._wall, self._peak = float(records["wall_seconds"]), records["peak_memory"]

    # --- how the run ended ------------------------------------------------------------------------

    def summary(self, trainer: Any) -> dict[str, Any]:
        """Return what ``summary.json`` holds; every figure is over the whole run, resumes included."""
        cfg = trainer.cfg
        last = self.history[-1] if self.history else {"val_loss": None, "val_acc": None}
        hit = self.reached
        stopped = hit is not None and trainer.step < trainer.total
        return {
            "train_loss": float(self.epoch[0] / self.epoch[2]) if self.epoch[2] > 0 else None,
            "val_loss": last["val_loss"],
            "val_acc": last["val_acc"],
            **({"val_ppl": last["val_ppl"]} if "val_ppl" in last else {}),  # a language model's perplexity
            **({k: last.get(k) for k in ("val_loss_ema", "val_acc_ema")} if cfg.train.ema > 0 else {}),
            "steps": trainer.step,
            "epochs": trainer.step / trainer.steps_per_epoch,
            "world_size": trainer.world,
            "variant": cfg.kfac.variant,
            "variant_used": trainer.variant,
            "stages": vars(trainer.stages),
            "seconds": self.wall_seconds,
            "step_time_median_s": self.times.median(),
            "breakdown_mean_s": self.times.means(),
            "history": self.history,
            "skipped_steps": self.skipped_steps,
            "repaired_params": self.repaired,
            "stopped_by": signal.Signals(trainer.stopped_by).name if trainer.stopped_by else None,
            # A stop is training left undone: a target first reached at the last step ended nothing early.
            "stopped_at_accuracy": self.target if stopped and self.target > 0 else None,
            "stopped_at_loss": self.loss_target if stopped and self.loss_target > 0 else None,
            "target_reached": None if hit is None else self.when(hit),
            "peak_gpu_memory_bytes": self.peak_memory,
        }


def _targets(hit: dict[str, float]) -> str:
    """The keys of the targets ``target_reached`` names, with their values: ``train.stop_at_accuracy=0.9``."""
    keys = (("target", "train.stop_at_accuracy"), ("loss_target", "train.stop_at_loss"))
    return " and ".join(f"{key}={hit[name]:g}" for name, key in keys if name in hit)


def target_line(summary: dict[str, Any], total: int) -> str | None:
    """Return the log line about ``train.stop_at_accuracy`` or ``stop_at_loss`` at the end of a run, or None."""
    hit = summary["target_reached"]
    if hit is None:
        return None
    if summary["stopped_at_accuracy"] is not None or summary.get("stopped_at_loss") is not None:
        return f"{_targets(hit)} reached: stopped at step {summary['steps']} of {total}"
    return f"{_targets(hit)} reached at step {hit['step']}, the run's last: it finished its budget (no stop)"


def finished_line(trainer: Any, run_dir: object, command: str) -> str:
    """Return the line a resume of a finished run prints: where it ended, nothing to do, and how to train on.

    Args:
        trainer: The resumed run's trainer (its checkpoint is loaded).
        run_dir: The run folder.
        command: The command that resumes it (:func:`kfacflow.running.launch.continue_command`).
    """
    cfg, hit = trainer.cfg, trainer.records.reached
    more = [f"train.steps={2 * trainer.step}" if cfg.train.steps else f"train.epochs={2 * cfg.train.epochs}"]
    raise_it = "raise train.steps or train.epochs"
    where = f"finished at step {trainer.step} of {trainer.total}"
    if hit is not None:
        found = f"val_acc {hit['val_acc']:.4f}" if cfg.train.stop_at_accuracy > 0 else f"val_loss {hit['val_loss']:.4f}"
        reached = f"reached {_targets(trainer.records.when(hit))} at step {hit['step']} ({found})"
        if trainer.step < trainer.total:
            where, raise_it, more = f"stopped at step {trainer.step} of {trainer.total}: it {reached}", "", []
        else:
            where, raise_it = f"{where} and {reached}", f"{raise_it}, and"
        keys = [k for k in ("stop_at_accuracy", "stop_at_loss") if getattr(cfg.train, k) > 0]
        change = {"stop_at_accuracy": "raise train.stop_at_accuracy", "stop_at_loss": "lower train.stop_at_loss"}
        raise_it += f" {' and '.join(change[k] for k in keys)} (0 turns it off)"
        more += [f"train.{k}=0" for k in keys]
    return f"resume: {run_dir} {where}; nothing to do. To train on, {raise_it.strip()}, e.g. {command} {' '.join(more)}"
