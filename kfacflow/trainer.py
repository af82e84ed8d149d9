"""The training loop: data, forward/backward, K-FAC step, optimizer, evaluation, checkpoints, logs."""

from __future__ import annotations

import logging
import math
import signal
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import nullcontext
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import Tensor

from kfacflow import rundir
from kfacflow.consistency import all_finite, check_replicas
from kfacflow.data import build_datasets, check_shard
from kfacflow.dist.base import Backend
from kfacflow.errors import StorageError, TrainingError, UserError
from kfacflow.kfac.preconditioner import KFACPreconditioner
from kfacflow.kfac.variants import resolve
from kfacflow.loader import eval_loader, train_loader
from kfacflow.models import build_model
from kfacflow.optim import build_optimizer, build_scheduler
from kfacflow.perf import Profile, calibrate
from kfacflow.registry import INVERSES
from kfacflow.reporting import Reporter
from kfacflow.resume import check_meta, check_model, checkpoint_meta
from kfacflow.seeding import rng_state, seed_all, set_rng_state
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)

PROFILE = "profile.yaml"
_HOOKS = Path(__file__).resolve().parent / "kfac"


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
        self.accumulate = cfg.train.accumulate
        train_set, val_set, info = build_datasets(cfg.data)
        check_shard(len(train_set), self.world, cfg.data.batch_size, self.accumulate)  # type: ignore[arg-type]
        seed_all(cfg.train.seed)  # identical initial weights on every rank
        model = build_model(cfg.model.name, info.num_classes, info.channels)
        self.model = model.to(self.device, self.dtype)
        self.stages = resolve(cfg.kfac)
        self.image = f"{info.channels}x{info.image_size}x{info.image_size}"
        # A resume is checked against what the checkpoint says before anything is calibrated or written.
        self._resume_state = self._read_resume() if cfg.resume else None
        self.timer = StepTimer(self.device)
        self.report = Reporter(cfg, run_dir, self.rank)
        self.kfac = None
        if self.stages.preconditioned:
            profile = self._profile() if self.stages.fusion == "optimal" or self.stages.placement == "lbp" else None
            self.kfac = KFACPreconditioner(
                self.model, cfg.kfac, self.stages, backend, profile, self.timer, accumulate=self.accumulate
            )
        self.net = backend.wrap_model(self.model)
        optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.optimizer = backend.wrap_optimizer(optimizer, self.model, self.accumulate)
        eval_batch = cfg.data.eval_batch_size or cfg.data.batch_size
        self.loader, self.sampler = train_loader(
            train_set, cfg.data.batch_size, self.rank, self.world, cfg.train.seed, cfg.data.workers
        )
        self.val_loader = eval_loader(val_set, eval_batch, self.rank, self.world, cfg.data.workers)
        self.steps_per_epoch = len(self.loader) // self.accumulate
        self.total = cfg.train.steps or cfg.train.epochs * self.steps_per_epoch
        if cfg.train.timeline > self.total:
            raise UserError(
                f"train.timeline={cfg.train.timeline} is after the run's last step ({self.total}); "
                f"pick a step from 1 to {self.total} (0 turns it off)."
            )
        self.epochs = math.ceil(self.total / self.steps_per_epoch)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, self.steps_per_epoch, self.total)
        self.step = 0
        self.history: list[dict[str, float]] = []
        seed_all(cfg.train.seed + 1 + self.rank)  # per-rank streams for dropout and augmentation
        self.stop_requested = 0
        """Signal number a handler set: stop after the current step (every rank agrees on when)."""
        self.stopped_by = 0
        self.nonfinite_in_row = 0
        self.skipped_steps = 0
        self._buffers: list[Tensor] = []
        self.repaired = 0
        """Parameter tensors found to differ from rank 0's and restored (see kfacflow.consistency)."""
        self._saved = (-1, 0)
        """(step, evaluations) of the newest checkpoint this process wrote or resumed from."""
        if self._resume_state is not None:
            self.load_state_dict(self._resume_state)
            self._resume_state = None
            self._saved = (self.step, len(self.history))

    @property
    def finished(self) -> bool:
        """Whether every step of the run is done (a resumed finished run has nothing to train)."""
        return self.step >= self.total

    @property
    def evaluated(self) -> bool:
        """Whether the validation set was evaluated after the current step."""
        return any(record["step"] == self.step for record in self.history)

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

    def _read_resume(self) -> dict[str, Any]:
        """Read the newest checkpoint of ``resume`` and check that it fits this run (every rank)."""
        state = rundir.load_latest_checkpoint(Path(self.cfg.resume))
        check_meta(state.get("meta"), self.cfg, self.world, self.stages.preconditioned)
        if state["world_size"] != self.world:
            check_meta({"world_size": state["world_size"]}, self.cfg, self.world, self.stages.preconditioned)
        check_model(state["model"], self.model, self.cfg)
        return state

    def state_dict(self) -> dict[str, Any]:
        """Return everything a resumed run needs (collective: every rank must call it)."""
        return {
            "step": self.step,
            "world_size": self.world,
            "meta": checkpoint_meta(self.cfg, self.world, self.stages.preconditioned),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "kfac": self.kfac.state_dict() if self.kfac else None,
            "history": self.history,
            "rng": self.backend.gather_objects(rng_state()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint written by :meth:`state_dict` (checked by :meth:`_read_resume`)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.kfac and state["kfac"]:
            self.kfac.load_state_dict(state["kfac"])
        self.step, self.history = int(state["step"]), list(state["history"])
        set_rng_state(state["rng"][self.rank])

    def checkpoint(self) -> None:
        """Check the replicas, then write a checkpoint (collective: rank 0 writes, every rank learns the outcome).

        Raises:
            TrainingError: If the parameters are non-finite (nothing is written).
            StorageError: On every rank, if rank 0 could not write it (the previous ones stay).
        """
        self.repaired += check_replicas(self.model, self.optimizer, self.backend, self.step)
        state = self.state_dict()
        error: StorageError | None = None
        if self.rank == 0:
            try:
                rundir.save_checkpoint(self.run_dir, self.step, state, self.cfg.train.keep_checkpoints)
            except StorageError as err:
                error = err
        failed = self.backend.allreduce_sum(torch.tensor([float(error is not None)]))
        if failed[0] > 0:
            raise error or StorageError("rank 0 could not write the checkpoint")
        self._saved = (self.step, len(self.history))

    # --- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``train.steps`` or ``train.epochs``; return the summary (all ranks).

        A resumed run that is already finished only runs its final evaluation if that is missing.
        """
        start = time.perf_counter()
        self.report.open(self.step, self.total)
        epoch_loss = (0.0, 0)
        while self.step < self.total:
            epoch, offset = divmod(self.step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch)
            self.sampler.skip = offset * self.cfg.data.batch_size * self.accumulate
            sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples (since last log)
            epoch_loss = (0.0, 0)
            for batches in self._steps():
                loss, correct, n = self._train_step(batches)
                sums += torch.tensor([loss * n, correct, n], dtype=torch.float64)
                epoch_loss = (epoch_loss[0] + loss * n, epoch_loss[1] + n)
                self.report.advance(loss, epoch + 1)
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
        if self.finished and not self.evaluated and not self.stopped_by:
            self._evaluate(self.step / self.steps_per_epoch)  # a resumed run stopped before its final evaluation
        if self._saved != (self.step, len(self.history)):
            self.checkpoint()
        else:
            self.repaired += check_replicas(self.model, self.optimizer, self.backend, self.step)
        totals = self.backend.allreduce_sum(torch.tensor(epoch_loss, dtype=torch.float64))
        train_loss = float(totals[0]) / float(totals[1]) if totals[1] > 0 else None
        summary = self.report.summary(self, train_loss, time.perf_counter() - start)
        self.report.close()
        return summary

    def _steps(self) -> Iterator[list[tuple[Tensor, Tensor]]]:
        """Yield the micro-batches of each step of the epoch (an incomplete last group is dropped)."""
        batches = iter(self.loader)
        while len(group := list(islice(batches, self.accumulate))) == self.accumulate:
            yield group

    def _train_step(self, batches: list[tuple[Tensor, Tensor]]) -> tuple[float, float, int]:
        """Run one optimizer step over ``batches`` (micro-batches); return mean loss, correct and samples."""
        timer = self.timer
        tic = timer.now()
        timer.begin_step(trace=self.step + 1 == self.cfg.train.timeline)
        self.net.train()
        # BatchNorm statistics move in the forward pass: a skipped step puts them back.
        self._buffers = [b.detach().clone() for b in self.model.buffers()]
        start = mid = end = timer.now()
        loss_sum, correct, samples = 0.0, 0.0, 0
        for i, (x, y) in enumerate(batches):
            x, y = x.to(self.device, self.dtype, non_blocking=True), y.to(self.device, non_blocking=True)
            # Gradients are averaged over ranks once, in the step's last backward pass.
            with self.backend.no_sync(self.net) if i < len(batches) - 1 else nullcontext():
                t0 = timer.now()
                out = self._forward(x)
                if self.kfac:
                    self.kfac.end_forward()
                loss = F.cross_entropy(out, y)
                mid = timer.now()
                (loss if len(batches) == 1 else loss / len(batches)).backward()
                end = timer.now()
            timer.record("forward", "compute", t0, mid)
            timer.record("backward", "compute", mid, end)
            loss_sum += float(loss.detach()) * y.shape[0]
            correct += float((out.detach().argmax(1) == y).sum())
            samples += y.shape[0]
        with timer.span("GradComm"):
            self.backend.finish_gradients(self.optimizer)
        grad_comm = end - self.backend.last_grad_launch if self.backend.last_grad_launch > mid else 0.0
        timer.add("GradComm", grad_comm)
        hooks = timer.parts["FactorComp"] + timer.parts["FactorComm"]  # factor work done inside forward/backward
        timer.add("FF&BP", max(0.0, end - start - hooks - grad_comm))
        value = loss_sum / samples
        if self._agree_to_skip(value, self._precondition()):
            return value, 0.0, samples
        self.backend.optimizer_step(self.optimizer)
        self._next_step()
        parts = timer.end_step(timer.now() - tic)
        self.report.step_timed(parts)
        if timer.tracing:
            self._write_timeline(parts)
        return value, correct, samples

    def _forward(self, x: Tensor) -> Tensor:
        """Run the model; on the first step an error from inside torch is about the data's shape."""
        if self.report.timings or self.skipped_steps:
            return self.net(x)  # type: ignore[no-any-return]
        try:
            return self.net(x)  # type: ignore[no-any-return]
        except (RuntimeError, ValueError) as err:
            frames = traceback.extract_tb(err.__traceback__)
            if any(Path(f.filename).resolve().is_relative_to(_HOOKS) for f in frames):
                raise  # raised in K-FAC's hooks: a bug of ours, keep the traceback
            message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"model.name={self.cfg.model.name} cannot run on this data ({self.image} images, "
                f"data.batch_size={self.cfg.data.batch_size}): {message}. Raise data.image_size, or choose a model "
                "made for this input size (e.g. resnet20 for 32 px)."
            ) from None

    def _precondition(self) -> bool:
        """Precondition the averaged gradients; return whether what would be applied is finite.

        The averaged gradients are the same on every rank, so every rank makes the same choice
        between the K-FAC step and dropping its factors.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        lr = self.optimizer.param_groups[0]["lr"]
        if not all_finite(grads) or not math.isfinite(lr):
            if self.kfac:
                self.kfac.skip_step()
            return False
        if self.kfac:
            self.kfac.step(lr)
            return all_finite(grads)
        return True

    def _next_step(self) -> None:
        """Clear the gradients and advance the schedule and the step count (a skipped step too)."""
        self.optimizer.zero_grad()  # set_to_none is the default (and all Horovod accepts)
        with warnings.catch_warnings():
            # A skipped first step advances the schedule before any optimizer step, on purpose.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
            self.scheduler.step()
        self.step += 1

    def _agree_to_skip(self, loss: float, finite_update: bool) -> bool:
        """Agree with every rank whether to skip this step (non-finite loss or update) and whether to stop.

        One small all-reduce a step: a skipped step updates nothing on any rank, so ranks never
        diverge. Too many skips in a row end training with a clear message, and so does a skip
        whose cause is already in the parameters (an earlier update overflowed).
        """
        bad = not math.isfinite(loss) or not finite_update
        flags = self.backend.allreduce_sum(torch.tensor([float(bad), float(self.stop_requested)]))
        if flags[1] > 0:
            self.stopped_by = self.stop_requested or signal.SIGTERM
        if flags[0] == 0:
            self.nonfinite_in_row = 0
            return False
        self.nonfinite_in_row += 1
        self.skipped_steps += 1
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), self._buffers, strict=True):
                buffer.copy_(saved)
        self._next_step()
        logger.warning(
            "step %d skipped on every rank: non-finite loss, gradient or update on %d rank(s)", self.step, int(flags[0])
        )
        hint = "lower optim.lr or optim.weight_decay, raise kfac.damping or kfac.kl_clip, or check the data"
        params = list(self.model.parameters())
        if not all_finite(params):
            raise TrainingError(f"the parameters are non-finite before step {self.step}: an update overflowed; {hint}.")
        if self.nonfinite_in_row >= self.cfg.train.max_nonfinite:
            raise TrainingError(
                f"the loss, gradients or update were non-finite in {self.nonfinite_in_row} steps in a row (up to "
                f"step {self.step}); {hint} (train.max_nonfinite sets the limit)."
            )
        return True

    def _write_timeline(self, parts: dict[str, float]) -> None:
        """Gather the traced step's events from every rank for rank 0's reporter."""
        events = self.backend.gather_objects(self.timer.events)
        self.report.timeline(events, self.kfac.layers if self.kfac else [], parts, self.step, self.world)

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
        self.report.evaluation(record)

    def _log_train(self, sums: Tensor) -> None:
        total = self.backend.allreduce_sum(sums)
        if total[2] > 0:
            lr = self.optimizer.param_groups[0]["lr"]
            self.report.train_scalars(self.step, float(total[0] / total[2]), float(total[1] / total[2]), lr)
