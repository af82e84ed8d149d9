"""The run log: what a run shows and keeps on rank 0 (progress bar, TensorBoard, timings.jsonl, metrics, traced step).

The trainer gathers the numbers (the collectives stay in the loop); this observer only writes them.
Every record is complete however the run ends: timing rows wait for the next training row, a
checkpoint or the end of the run, whichever comes first (:meth:`RunLog.flush`), and what a row
adds up since the previous one travels in the checkpoint (:meth:`RunLog.state_dict`).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kfacflow.configuration.recipe import to_yaml
from kfacflow.running import rundir
from kfacflow.timing import summarize

logger = logging.getLogger(__name__)

TIMINGS = "timings.jsonl"
METRICS = ("step", "kind", "loss", "acc", "lr", "step_s", "images_per_s", "seconds", "kl_clip_scale")
"""The columns of ``metrics.csv`` (``train.metrics=csv``); training rows leave ``seconds`` (the training seconds
so far) empty, validation rows ``lr``, ``step_s``, ``images_per_s`` and ``kl_clip_scale`` (the mean factor KL
clipping scaled K-FAC's updates by since the last row; empty without K-FAC or clipping)."""


class RunLog:
    """Rank 0's view of the run (every method is a no-op on other ranks).

    Args:
        cfg: The recipe.
        run_dir: The run folder.
        rank: This worker's rank.
    """

    def __init__(self, cfg: DictConfig, run_dir: Path, rank: int, world: int = 1) -> None:
        self.cfg, self.run_dir, self.on = cfg, run_dir, rank == 0
        self.images_per_step = cfg.data.batch_size * cfg.train.accumulate * world
        self.writer: Any = None
        self.bar: Any = None
        self.lines = False
        """A plain log line every ``train.log_every`` steps instead of the bar (output is not a terminal)."""
        self.total = 0
        self.timings: list[dict[str, float]] = []
        """The breakdown of each step timed since the last training row (a skipped step is not timed)."""
        self._pending: list[str] = []
        """Rows of timings.jsonl not written yet."""
        self._last_train: dict[str, Any] = {}
        """The step and TensorBoard scalars of the last training row (a resume from that step writes them again)."""
        self._traced: list[tuple[int, dict[str, Any]]] = []
        """Each traced step's number and :func:`~kfacflow.running.timeline.layer_profile` (``train.timeline_steps``)."""
        self._columns: tuple[str, ...] | None = None
        """The columns of ``metrics.csv``: this version's, or those of the file an earlier version began."""

    def open(self, step: int, total: int, history: list[dict[str, float]], logged: bool = True) -> None:
        """Start TensorBoard and the bar; a resume from ``step`` first drops what an earlier life logged after it.

        Args:
            step: The step the run starts from (a resume's checkpoint's; 0 for a new run).
            total: The run's last step.
            history: The checkpoint's evaluations (one logged at ``step`` that it does not hold is dropped).
            logged: Whether the checkpoint's steps were all in training rows (else a row at ``step``, written
                when a process ended between two rows, is dropped: the run logs those steps again).

        Raises:
            StorageError: If a log file cannot be rewritten.
        """
        if not self.on:
            return
        from torch.utils.tensorboard import SummaryWriter

        evaluations = [record for record in history if record["step"] == step] if step else []
        if step:
            self._drop_after(step, bool(evaluations), logged)
        self.writer = SummaryWriter(str(self.run_dir), purge_step=step or None)
        self.writer.add_text("config", "```\n" + to_yaml(self.cfg) + "\n```", step)
        # TensorBoard hides every event from purge_step on: what the run keeps at that step is written again.
        for tag, value in self._last_train.get("scalars", {}).items() if self._last_train.get("step") == step else ():
            self.writer.add_scalar(tag, value, step)
        for record in evaluations:
            self._evaluation_scalars(record)
        self.total = total
        if self.cfg.train.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=step, desc=self.cfg.name, unit="step", dynamic_ncols=True)
        else:  # a piped log would get a bar redraw per step, joined by carriage returns
            self.lines = self.cfg.train.progress

    def advance(self, loss: float, epoch: int) -> None:
        """Move the bar by one step."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", epoch=epoch)

    def step_timed(self, step: int, parts: dict[str, float]) -> None:
        """Keep the breakdown of the run's step ``step``."""
        self.timings.append(parts)
        if self.on:
            self._pending.append(json.dumps({"step": step, **parts}) + "\n")

    def flush(self) -> None:
        """Append the timing rows not written yet to timings.jsonl.

        Raises:
            StorageError: If it cannot be written.
        """
        if self._pending:
            rundir.append_lines(self.run_dir / TIMINGS, self._pending)
            self._pending = []

    def state_dict(self) -> dict[str, Any]:
        """Return what a checkpoint keeps: the timings since the last training row, that row's scalars, traced steps."""
        return {"timings": [dict(p) for p in self.timings], "last_train": self._last_train, "traced": self._traced}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Go on from what :meth:`state_dict` returned (None: a checkpoint written before it was kept)."""
        if state:
            self.timings, self._last_train = [dict(p) for p in state["timings"]], dict(state["last_train"])
            self._traced = [(int(step), dict(profile)) for step, profile in state["traced"]]

    def _drop_after(self, step: int, evaluated: bool, logged: bool) -> None:
        """Keep the rows of timings.jsonl and metrics.* up to the checkpoint ``step``, as TensorBoard's purge_step does.

        The run goes on from there and logs the later steps again. A row cut short (the process died while
        appending it) is dropped too, so that the next row starts on a line of its own; so are an evaluation at
        ``step`` the checkpoint does not hold and, unless ``logged``, a training row at ``step``.
        """

        def kept(row_step: object, kind: object) -> bool:
            if not isinstance(row_step, int) or isinstance(row_step, bool):
                return False
            if row_step != step:
                return row_step < step
            return evaluated if str(kind).startswith("val") else logged or kind is None  # timing rows: None

        def json_row(line: str) -> bool:
            try:
                row = json.loads(line)
            except ValueError:
                return False
            return isinstance(row, dict) and kept(row.get("step"), row.get("kind"))

        width = [len(METRICS)]

        def csv_row(line: str) -> bool:
            cells = line.split(",")
            if cells[:2] == ["step", "kind"]:  # the header: this version's, or an earlier one's with fewer columns
                width[0] = len(cells)
                return True
            return len(cells) == width[0] and cells[0].isdigit() and kept(int(cells[0]), cells[1])

        for name, keep in ((TIMINGS, json_row), ("metrics.jsonl", json_row), ("metrics.csv", csv_row)):
            rundir.keep_lines(self.run_dir / name, keep)

    def train_scalars(self, step: int, loss: float, acc: float, lr: float, clip: float | None = None) -> None:
        """Write the training scalars and the breakdown of the steps since the last call, and append timings.jsonl.

        ``clip``: the mean KL clipping factor of those steps (``kfac/kl_clip_scale``; None: no K-FAC or no clipping).

        Raises:
            StorageError: If timings.jsonl cannot be written.
        """
        fresh, self.timings = self.timings, []
        if not self.on:
            return
        mean = summarize(fresh, 0)
        record: dict[str, Any] = {"step": step, "kind": "train", "loss": loss, "acc": acc, "lr": lr}
        scalars = {"train/loss": loss, "train/acc": acc, "train/lr": lr}
        if clip is not None:
            record["kl_clip_scale"] = scalars["kfac/kl_clip_scale"] = clip
        if fresh:
            record["step_s"] = mean["total"]
            record["images_per_s"] = self.images_per_step / mean["total"] if mean["total"] > 0 else None
            scalars["time/step_s"] = fresh[-1]["total"]
            if record["images_per_s"] is not None:
                scalars["time/images_per_s"] = record["images_per_s"]
        scalars |= {f"breakdown/{part}": seconds for part, seconds in mean.items()}
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self._last_train = {"step": step, "scalars": scalars}
        self.flush()
        self._metrics(record)
        if self.lines:
            speed = f", {record['step_s']:.3f} s/step, {record['images_per_s']:.0f} images/s" if fresh else ""
            speed += f", KL clip x{clip:.3g}" if clip is not None and clip < 1 else ""
            logger.info(
                "%s: step %d/%d, loss %.4f, acc %.4f, lr %.3g%s", self.cfg.name, step, self.total, loss, acc, lr, speed
            )

    def _metrics(self, record: dict[str, Any]) -> None:
        """Append one row to ``metrics.csv`` or ``metrics.jsonl`` (``train.metrics``)."""
        kind = self.cfg.train.metrics
        if kind == "jsonl":
            rundir.append_lines(self.run_dir / "metrics.jsonl", [json.dumps(record) + "\n"])
        elif kind == "csv":
            path = self.run_dir / "metrics.csv"
            header = []
            if self._columns is None:  # once a process: a file an earlier version began keeps its columns
                if path.is_file() and path.stat().st_size:
                    with open(path) as fh:
                        self._columns = tuple(fh.readline().strip().split(","))
                else:
                    self._columns, header = METRICS, [",".join(METRICS) + "\n"]
            row = ",".join("" if record.get(k) is None else str(record[k]) for k in self._columns) + "\n"
            rundir.append_lines(path, [*header, row])

    def evaluation(self, record: dict[str, float]) -> None:
        """Write one evaluation."""
        if not self.on:
            return
        self._evaluation_scalars(record)
        at = {"step": record["step"], "seconds": record["seconds"]}
        for suffix in ("", "_ema") if "val_acc_ema" in record else ("",):
            row = {"kind": f"val{suffix}", "loss": record[f"val_loss{suffix}"], "acc": record[f"val_acc{suffix}"]}
            if f"val_ppl{suffix}" in record:  # a language model's: in metrics.jsonl (metrics.csv keeps its columns)
                row["ppl"] = record[f"val_ppl{suffix}"]
            self._metrics(at | row)
        ppl = f" val_ppl {record['val_ppl']:.3f}" if "val_ppl" in record else ""  # a language model's
        loss, acc = record["val_loss"], record["val_acc"]
        logger.info("epoch %g: val_loss %.4f val_acc %.4f%s", record["epoch"], loss, acc, ppl)

    def _evaluation_scalars(self, record: dict[str, float]) -> None:
        for suffix in ("", "_ema") if "val_acc_ema" in record else ("",):
            for name in ("loss", "acc", "ppl") if "val_ppl" in record else ("loss", "acc"):
                self.writer.add_scalar(f"val{suffix}/{name}", record[f"val_{name}{suffix}"], record["step"])

    def timeline(
        self, events: list[Any], layers: list[Any], parts: dict[str, float], step: int, world: int, inverse: str
    ) -> None:
        """Write a traced step: layers.json (the mean of those traced so far); the first's trace and picture too."""
        if not self.on:
            return
        from kfacflow.running.timeline import layer_profile, mean_profile, write_timeline

        cfg = self.cfg
        self._traced.append((step, layer_profile(events, layers, parts, world, cfg.data.batch_size, inverse)))
        profile = mean_profile([p for _, p in self._traced], [s for s, _ in self._traced])
        profile = {"model": cfg.model.name, "image_size": cfg.data.image_size, **profile}
        rundir.write_atomic(self.run_dir / "layers.json", json.dumps(profile, indent=1).encode())
        if len(self._traced) > 1:
            return
        title = (
            f"{cfg.name}: step {step} of {cfg.model.name}, {cfg.kfac.variant}, {world} "
            f"worker{'s' if world > 1 else ''}, {parts.get('total', 0.0):.2f} s"
        )
        figure = write_timeline(events, self.run_dir, title)
        if figure is not None:
            self.writer.add_figure("timeline", figure, step)

    def close(self) -> None:
        """Write the timing rows not written yet, then close the bar and TensorBoard.

        Raises:
            StorageError: If timings.jsonl cannot be written (the bar and TensorBoard are closed all the same).
        """
        try:
            self.flush()
        finally:
            if self.bar is not None:
                self.bar.close()
            if self.writer is not None:
                self.writer.close()
