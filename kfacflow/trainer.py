"""The training loop: data, forward/backward, K-FAC step, optimizer, evaluation, checkpoints, logs."""

from __future__ import annotations

import json
import logging
import math
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from kfacflow import rundir
from kfacflow.config import to_yaml
from kfacflow.data import build_datasets, check_shard
from kfacflow.dist.base import Backend
from kfacflow.errors import TrainingError
from kfacflow.kfac.preconditioner import KFACPreconditioner
from kfacflow.kfac.variants import resolve
from kfacflow.loader import eval_loader, train_loader
from kfacflow.models import build_model
from kfacflow.optim import build_optimizer, build_scheduler
from kfacflow.perf import Profile, calibrate
from kfacflow.registry import INVERSES
from kfacflow.timing import StepTimer, summarize

logger = logging.getLogger(__name__)

PROFILE = "profile.yaml"
TIMINGS = "timings.jsonl"


def rng_state() -> dict[str, Any]:
    """Return this process's random number generator states."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_all(seed: int) -> None:
    """Seed torch, numpy and random."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class Trainer:
    """Builds model, data, optimizer and preconditioner from a recipe and trains.

    Args:
        cfg: The validated recipe.
        backend: The communication engine this worker joined.
        run_dir: The run folder (rank 0 writes into it).
    """

    def __init__(self, cfg: DictConfig, backend: Backend, run_dir: Path) -> None:
        self.cfg, self.backend, self.run_dir = cfg, backend, run_dir
        self.rank, self.world = backend.rank, backend.world_size
        self.dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
        self.device = backend.device
        train_set, val_set, info = build_datasets(cfg.data)
        check_shard(len(train_set), self.world, cfg.data.batch_size)  # type: ignore[arg-type]
        seed_all(cfg.train.seed)  # identical initial weights on every rank
        model = build_model(cfg.model.name, info.num_classes, info.channels)
        self.model = model.to(self.device, self.dtype)
        self.stages = resolve(cfg.kfac)
        self.timer = StepTimer(self.device)
        self.timings: list[dict[str, float]] = []
        self._timings_written = 0
        self.kfac = None
        if self.stages.preconditioned:
            profile = self._profile() if self.stages.fusion == "optimal" or self.stages.placement == "lbp" else None
            self.kfac = KFACPreconditioner(self.model, cfg.kfac, self.stages, backend, profile, self.timer)
        self.net = backend.wrap_model(self.model)
        self.optimizer = backend.wrap_optimizer(build_optimizer(self.model.parameters(), cfg.optim), self.model)
        eval_batch = cfg.data.eval_batch_size or cfg.data.batch_size
        self.loader, self.sampler = train_loader(
            train_set, cfg.data.batch_size, self.rank, self.world, cfg.train.seed, cfg.data.workers
        )
        self.val_loader = eval_loader(val_set, eval_batch, self.rank, self.world, cfg.data.workers)
        self.steps_per_epoch = len(self.loader)
        self.total = cfg.train.steps or cfg.train.epochs * self.steps_per_epoch
        self.epochs = math.ceil(self.total / self.steps_per_epoch)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, self.steps_per_epoch, self.total)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.step_times: list[float] = []
        seed_all(cfg.train.seed + 1 + self.rank)  # per-rank streams for dropout and augmentation
        self.writer: Any = None
        self.stop_requested = 0
        """Signal number a handler set: stop after the current step (every rank agrees on when)."""
        self.stopped_by = 0
        self.nonfinite_in_row = 0
        self.skipped_steps = 0

    def _profile(self) -> Profile:
        """Load the recipe's profile (or the resumed run's), else calibrate now and save it in the run folder."""
        path = self.cfg.kfac.profile or (self.run_dir / PROFILE if (self.run_dir / PROFILE).is_file() else None)
        if path is not None:
            profile: Profile = self.backend.broadcast_object(Profile.load(path) if self.rank == 0 else None)
            return profile
        profile = calibrate(self.backend, INVERSES.get(self.stages.inverse), self.dtype)
        if self.rank == 0:
            profile.save(self.run_dir / PROFILE)
            logger.info(
                "calibrated: all-reduce %.2e + %.2e m s, broadcast %.2e + %.2e m s, inverse %s (error %.0f%%)",
                profile.allreduce.alpha,
                profile.allreduce.beta,
                profile.broadcast.alpha,
                profile.broadcast.beta,
                profile.inverse.kind,
                100 * profile.inverse.error,
            )
        return profile

    # --- checkpoints --------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Return everything a resumed run needs (collective: every rank must call it)."""
        return {
            "step": self.step,
            "world_size": self.world,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "kfac": self.kfac.state_dict() if self.kfac else None,
            "history": self.history,
            "rng": self.backend.gather_objects(rng_state()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint written by :meth:`state_dict`."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.kfac and state["kfac"]:
            self.kfac.load_state_dict(state["kfac"])
        self.step, self.history = int(state["step"]), list(state["history"])
        if state["world_size"] == self.world:
            set_rng_state(state["rng"][self.rank])
        else:
            logger.warning(
                "resuming %d workers from a %d-worker checkpoint: random streams restart",
                self.world,
                state["world_size"],
            )

    def checkpoint(self) -> None:
        """Write a checkpoint (rank 0 writes; every rank takes part in gathering RNG states)."""
        state = self.state_dict()
        if self.rank == 0:
            rundir.save_checkpoint(self.run_dir, self.step, state, self.cfg.train.keep_checkpoints)

    # --- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``train.steps`` or ``train.epochs``; return the summary (all ranks)."""
        start = time.perf_counter()
        if self.cfg.resume:
            self.load_state_dict(rundir.load_latest_checkpoint(Path(self.cfg.resume)))
        if self.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir), purge_step=self.step or None)
            self.writer.add_text("config", "```\n" + to_yaml(self.cfg) + "\n```", self.step)
        bar = self._progress()
        epoch_loss = (0.0, 0)
        while self.step < self.total:
            epoch, offset = divmod(self.step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch)
            self.sampler.skip = offset * self.cfg.data.batch_size
            sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples (since last log)
            epoch_loss = (0.0, 0)
            for x, y in self.loader:
                loss, correct = self._train_step(x, y)
                n = y.shape[0]
                sums += torch.tensor([loss * n, correct, n], dtype=torch.float64)
                epoch_loss = (epoch_loss[0] + loss * n, epoch_loss[1] + n)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}", epoch=epoch + 1)
                if self.step % self.cfg.train.log_every == 0 or self.step == self.total:
                    self._log_train(sums)
                    sums.zero_()
                if self.cfg.train.checkpoint_every and self.step % self.cfg.train.checkpoint_every == 0:
                    self.checkpoint()
                if self.step >= self.total or self.step % self.steps_per_epoch == 0 or self.stopped_by:
                    break
            if self.stopped_by:
                break
            done_epoch = self.step % self.steps_per_epoch == 0
            last = self.step >= self.total
            if last or (done_epoch and (epoch + 1) % self.cfg.train.eval_every == 0):
                self._evaluate(epoch + 1)
            if done_epoch and not self.cfg.train.checkpoint_every and not last:
                self.checkpoint()
        if bar is not None:
            bar.close()
        if not self.cfg.train.checkpoint_every or self.step % self.cfg.train.checkpoint_every:
            self.checkpoint()
        totals = self.backend.allreduce_sum(torch.tensor(epoch_loss, dtype=torch.float64))
        summary = self._summary(float(totals[0]) / max(float(totals[1]), 1.0), time.perf_counter() - start)
        if self.writer is not None:
            self.writer.close()
        return summary

    def _train_step(self, x: Tensor, y: Tensor) -> tuple[float, float]:
        timer = self.timer
        tic = timer.now()
        timer.begin_step(trace=self.step + 1 == self.cfg.train.timeline)
        x, y = x.to(self.device, self.dtype, non_blocking=True), y.to(self.device, non_blocking=True)
        self.net.train()
        start = timer.now()
        out = self.net(x)
        if self.kfac:
            self.kfac.end_forward()
        loss = F.cross_entropy(out, y)
        mid = timer.now()
        loss.backward()
        end = timer.now()
        with timer.span("GradComm"):
            self.backend.finish_gradients(self.optimizer)
        value = float(loss.detach())
        if self._agree_to_skip(value):
            return value, 0.0
        grad_comm = end - self.backend.last_grad_launch if self.backend.last_grad_launch > mid else 0.0
        timer.add("GradComm", grad_comm)
        hooks = timer.parts["FactorComp"] + timer.parts["FactorComm"]  # factor work done inside forward/backward
        timer.add("FF&BP", max(0.0, end - start - hooks - grad_comm))
        timer.record("forward", "compute", start, mid)
        timer.record("backward", "compute", mid, end)
        lr = self.optimizer.param_groups[0]["lr"]
        if self.kfac:
            self.kfac.step(lr)
        self.backend.optimizer_step(self.optimizer)
        self._next_step()
        correct = float((out.detach().argmax(1) == y).sum())
        parts = timer.end_step(timer.now() - tic)
        self.timings.append(parts)
        self.step_times.append(parts["total"])
        if timer.tracing:
            self._write_timeline(parts)
        return value, correct

    def _next_step(self) -> None:
        """Clear the gradients and advance the schedule and the step count (a skipped step too)."""
        self.optimizer.zero_grad()  # set_to_none is the default (and all Horovod accepts)
        self.scheduler.step()
        self.step += 1

    def _agree_to_skip(self, loss: float) -> bool:
        """Agree with every rank whether to skip this step (non-finite loss or gradient) and whether to stop.

        One small all-reduce a step: a skipped step updates nothing on any rank, so ranks never
        diverge. Too many skips in a row end training with a clear message.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        bad = not math.isfinite(loss) or not bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
        flags = self.backend.allreduce_sum(torch.tensor([float(bad), float(self.stop_requested)]))
        if flags[1] > 0:
            self.stopped_by = self.stop_requested or signal.SIGTERM
        if flags[0] == 0:
            self.nonfinite_in_row = 0
            return False
        self.nonfinite_in_row += 1
        self.skipped_steps += 1
        if self.kfac:
            self.kfac.skip_step()
        self._next_step()
        logger.warning(
            "step %d skipped on every rank: non-finite loss or gradient on %d rank(s)", self.step, int(flags[0])
        )
        if self.nonfinite_in_row >= self.cfg.train.max_nonfinite:
            raise TrainingError(
                f"the loss or gradients were non-finite in {self.nonfinite_in_row} steps in a row (up to step "
                f"{self.step}); lower optim.lr, raise kfac.damping, or check the data "
                "(train.max_nonfinite sets the limit)."
            )
        return True

    def _write_timeline(self, parts: dict[str, float]) -> None:
        """Gather the traced step's events from every rank; rank 0 writes the trace, its picture, the layer profile."""
        events = self.backend.gather_objects(self.timer.events)
        if self.rank != 0:
            return
        from kfacflow.timeline import layer_profile, write_timeline

        layers = self.kfac.layers if self.kfac else []
        profile = layer_profile(events, layers, parts, self.world, self.cfg.data.batch_size)
        profile = {"model": self.cfg.model.name, "image_size": self.cfg.data.image_size, **profile}
        rundir.write_atomic(self.run_dir / "layers.json", json.dumps(profile, indent=1).encode())
        figure = write_timeline(events, self.run_dir, f"{self.cfg.name}: step {self.step} ({self.cfg.kfac.variant})")
        if self.writer is not None and figure is not None:
            self.writer.add_figure("timeline", figure, self.step)

    @torch.no_grad()
    def _evaluate(self, epoch: float) -> None:
        self.net.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for x, y in self.val_loader:
            x, y = x.to(self.device, self.dtype), y.to(self.device)
            out = self.net(x)
            sums += torch.stack(
                [
                    F.cross_entropy(out, y, reduction="sum").double(),
                    (out.argmax(1) == y).sum().double(),
                    torch.tensor(float(y.shape[0]), dtype=torch.float64, device=self.device),
                ]
            )
        total = self.backend.allreduce_sum(sums).cpu()
        n = max(float(total[2]), 1.0)
        record = {"epoch": epoch, "step": self.step, "val_loss": float(total[0]) / n, "val_acc": float(total[1]) / n}
        self.history.append(record)
        if self.writer is not None:
            self.writer.add_scalar("val/loss", record["val_loss"], self.step)
            self.writer.add_scalar("val/acc", record["val_acc"], self.step)
            logger.info("epoch %g: val_loss %.4f val_acc %.4f", epoch, record["val_loss"], record["val_acc"])

    def _log_train(self, sums: Tensor) -> None:
        total = self.backend.allreduce_sum(sums)
        if self.writer is None or total[2] == 0:
            return
        self.writer.add_scalar("train/loss", float(total[0] / total[2]), self.step)
        self.writer.add_scalar("train/acc", float(total[1] / total[2]), self.step)
        self.writer.add_scalar("train/lr", self.optimizer.param_groups[0]["lr"], self.step)
        self.writer.add_scalar("time/step_s", self.step_times[-1], self.step)
        fresh = self.timings[self._timings_written :]
        for part, seconds in summarize(fresh, 0).items():
            self.writer.add_scalar(f"breakdown/{part}", seconds, self.step)
        with open(self.run_dir / TIMINGS, "a") as f:
            f.writelines(json.dumps({"step": self._timings_written + i + 1, **p}) + "\n" for i, p in enumerate(fresh))
        self._timings_written = len(self.timings)

    def _progress(self) -> Any:
        if self.rank != 0 or not self.cfg.train.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=self.total, initial=self.step, desc=self.cfg.name, unit="step", dynamic_ncols=True)

    def _summary(self, train_loss: float, seconds: float) -> dict[str, Any]:
        warm = self.cfg.train.timing_warmup
        last = self.history[-1] if self.history else {"val_loss": None, "val_acc": None}
        return {
            "train_loss": train_loss,
            "val_loss": last["val_loss"],
            "val_acc": last["val_acc"],
            "steps": self.step,
            "epochs": self.step / self.steps_per_epoch,
            "world_size": self.world,
            "variant": self.cfg.kfac.variant,
            "stages": vars(self.stages),
            "seconds": seconds,
            "step_time_median_s": statistics.median(self.step_times[warm:] or self.step_times),
            "breakdown_mean_s": summarize(self.timings, warm),
            "history": self.history,
            "skipped_steps": self.skipped_steps,
            "stopped_by": signal.Signals(self.stopped_by).name if self.stopped_by else None,
        }
