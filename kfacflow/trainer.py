"""The training loop: data, forward/backward, K-FAC step, optimizer, evaluation, checkpoints, logs."""

from __future__ import annotations

import logging
import math
import signal
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from kfacflow import StorageError, UserError, auto, build, registry, rundir
from kfacflow.build import Training
from kfacflow.comm.base import Backend
from kfacflow.consistency import all_finite, check_replicas, skipped
from kfacflow.data_checks import cross_entropy
from kfacflow.precision import MixedPrecision
from kfacflow.resume import checkpoint_meta
from kfacflow.runlog import RunLog
from kfacflow.seeding import rng_state, set_rng_state
from kfacflow.timeline import layer_profile, traced_steps
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)

_HOOKS = Path(__file__).resolve().parent / "kfac"


class Trainer:
    """Trains what :func:`kfacflow.build.training` built from a recipe.

    Args:
        cfg: The validated recipe.
        built: The model, K-FAC, optimizer, schedule and loaders.
        backend: The communication engine this worker joined.
        run_dir: The run folder (rank 0 writes into it).
        timer: The step timer K-FAC reports to (the one ``built`` was made with).
    """

    def __init__(self, cfg: DictConfig, built: Training, backend: Backend, run_dir: Path, timer: StepTimer) -> None:
        self.cfg, self.backend, self.run_dir, self.timer = cfg, backend, run_dir, timer
        self.rank, self.world = backend.rank, backend.world_size
        self.device, self.dtype, self.accumulate = backend.device, built.dtype, cfg.train.accumulate
        self.memory_format = torch.channels_last if cfg.train.channels_last else torch.preserve_format
        """The images' memory format, the model's (``train.channels_last``)."""
        self.model, self.net, self.kfac = built.model, built.net, built.kfac
        self.optimizer, self.scheduler = built.optimizer, built.scheduler
        self.loader, self.sampler, self.val_loader = built.loader, built.sampler, built.val_loader
        self.stages, self.steps_per_epoch, self.total = built.stages, built.steps_per_epoch, built.total
        self._traced_steps = set(traced_steps(cfg.train))
        """The steps traced for the run log (``train.timeline``)."""
        self.variant = cfg.kfac.variant
        """The variant in force (``auto`` becomes the preset it chose)."""
        self.image = f"{built.info.channels}x{built.info.image_size}x{built.info.image_size}"
        self.report = RunLog(cfg, run_dir, self.rank, self.world)
        self.precision = MixedPrecision(cfg.train.amp, self.device, cfg.train.loss_scale)
        if self.kfac:
            self.kfac.grad_scaler = self.precision.scaler
        self.ema = (
            AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(cfg.train.ema), use_buffers=True)
            if cfg.train.ema > 0
            else None
        )
        """The moving average of the weights (``train.ema``); every rank keeps the same one."""
        self.step = 0
        self.history: list[dict[str, float]] = []
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
        self._seconds = 0.0
        """Training seconds of earlier processes of this run (a resume) and of this one until ``_since``."""
        self._since: float | None = None
        if built.resume_state is not None:
            self.load_state_dict(built.resume_state)
            self._saved = (self.step, len(self.history))
        self._began = self.step
        """The step this process started from: ``kfac.variant=auto`` chooses on its own second step."""

    @classmethod
    def from_recipe(cls, cfg: DictConfig, backend: Backend, run_dir: Path) -> Trainer:
        """Build everything ``cfg`` describes (a resume is checked first) and return its trainer."""
        timer = StepTimer(backend.device, cfg.train.timing)
        backend.clock = timer.mark  # DDP's bucket launches, as points the timer can compare
        return cls(cfg, build.training(cfg, backend, run_dir, timer), backend, run_dir, timer)

    @property
    def finished(self) -> bool:
        """Whether every step of the run is done (a resumed finished run has nothing to train)."""
        return self.step >= self.total

    @property
    def train_seconds(self) -> float:
        """Wall seconds spent training in this run so far, over resumes; evaluations and checkpoints left out."""
        return self._seconds + (0.0 if self._since is None else time.perf_counter() - self._since)

    @contextmanager
    def _not_training(self) -> Iterator[None]:
        """Leave the ``with`` body out of every step and out of :attr:`train_seconds`."""
        seconds, self._since = self.train_seconds, None
        try:
            with self.timer.outside():
                yield
        finally:
            self._seconds, self._since = seconds, time.perf_counter()

    @property
    def reached_target(self) -> bool:
        """Whether an evaluation reached ``train.stop_at_accuracy`` (every rank holds the same history)."""
        target = self.cfg.train.stop_at_accuracy
        return target > 0 and any(record["val_acc"] >= target for record in self.history)

    @property
    def evaluated(self) -> bool:
        """Whether the validation set was evaluated after the current step."""
        return any(record["step"] == self.step for record in self.history)

    # --- checkpoints --------------------------------------------------------------------

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
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "loss_scale": self.precision.state_dict(),
            "history": self.history,
            "train_seconds": self.train_seconds,
            "rng": self.backend.gather_objects(rng_state()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint written by :meth:`state_dict` (checked by :func:`kfacflow.build.training`)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.kfac and state["kfac"]:
            self.kfac.load_state_dict(state["kfac"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])  # a run resumed with train.ema newly on starts it afresh
        self.precision.load_state_dict(state.get("loss_scale"))
        self.step, self.history = int(state["step"]), list(state["history"])
        self._seconds = float(state.get("train_seconds", 0.0))  # written before it was kept: counted from here
        set_rng_state(state["rng"][self.rank])

    def checkpoint(self) -> None:
        """Check the replicas, then write a checkpoint (collective: rank 0 writes, every rank learns the outcome).

        Raises:
            TrainingError: If the parameters are non-finite (nothing is written).
            StorageError: On every rank, if rank 0 could not write it (the previous ones stay).
        """
        with self._not_training():
            self._checkpoint()

    def _checkpoint(self) -> None:
        self.repaired += check_replicas(self.model, self.optimizer, self.backend, self.step)
        if not self.cfg.train.save:  # every rank alike: the state is gathered collectively
            self._saved = (self.step, len(self.history))
            return
        state = self.state_dict()
        error: StorageError | None = None
        if self.rank == 0:
            try:
                rundir.save_checkpoint(self.run_dir, self.step, state, self.cfg.train.keep_checkpoints)
            except StorageError as err:
                error = err
        # Slow storage is no failure: the others wait outside the collectives' timeout (dist.timeout_s).
        self.backend.await_rank0()
        failed = self.backend.allreduce_sum(torch.tensor([float(error is not None)]))
        if failed[0] > 0:
            raise error or StorageError("rank 0 could not write the checkpoint")
        self._saved = (self.step, len(self.history))

    # --- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``train.steps`` or ``train.epochs``; return the summary (all ranks).

        A resumed run that is already finished only runs its final evaluation if that is missing.
        """
        start = self._since = time.perf_counter()
        self.report.open(self.step, self.total, self.evaluated)
        every = self.cfg.train.eval_every_steps
        epoch_loss = (0.0, 0)
        while self.step < self.total and not self.reached_target:
            epoch, offset = divmod(self.step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch)
            self.sampler.skip = offset * self.cfg.data.batch_size * self.accumulate
            # Loss sum, correct, samples over every rank (since the last log, and this epoch).
            sums = torch.zeros(3, dtype=torch.float64)
            epoch_sums = torch.zeros(3, dtype=torch.float64)
            for batches in self._steps():
                loss, totals = self._train_step(batches)
                sums += totals
                epoch_sums += totals
                self.report.advance(loss, epoch + 1)
                if self.step % self.cfg.train.log_every == 0 or self.step == self.total:
                    self._log_train(sums)
                    sums.zero_()
                if every and self.step % every == 0 and self.step < self.total:
                    self._evaluate(self.step / self.steps_per_epoch)
                if self.cfg.train.checkpoint_every and self.step % self.cfg.train.checkpoint_every == 0:
                    self.checkpoint()
                if self.step >= self.total or self.step % self.steps_per_epoch == 0 or self.stopped_by:
                    break
                if every and self.step % every == 0 and self.reached_target:
                    break
            epoch_loss = (float(epoch_sums[0]), int(epoch_sums[2]))
            if self.stopped_by:
                break
            done_epoch = self.step % self.steps_per_epoch == 0
            last = self.step >= self.total
            if (last or (done_epoch and (epoch + 1) % self.cfg.train.eval_every == 0)) and not self.evaluated:
                self._evaluate(epoch + 1 if done_epoch else self.step / self.steps_per_epoch)
            if done_epoch and not self.cfg.train.checkpoint_every and not last:
                self.checkpoint()
        if self.finished and not self.evaluated and not self.stopped_by:
            self._evaluate(self.step / self.steps_per_epoch)  # a resumed run stopped before its final evaluation
        if self._saved != (self.step, len(self.history)):
            self.checkpoint()
        else:
            self.repaired += check_replicas(self.model, self.optimizer, self.backend, self.step)
        train_loss = epoch_loss[0] / epoch_loss[1] if epoch_loss[1] > 0 else None
        summary = self.report.summary(self, train_loss, time.perf_counter() - start)
        self.report.close()
        return summary

    def _steps(self) -> Iterator[list[tuple[Tensor, Tensor]]]:
        """Yield the micro-batches of each step of the epoch (an incomplete last group is dropped)."""
        batches = iter(self.loader)
        while len(group := list(islice(batches, self.accumulate))) == self.accumulate:
            yield group

    def _train_step(self, batches: list[tuple[Tensor, Tensor]]) -> tuple[float, Tensor]:
        """One optimizer step over ``batches`` (micro-batches).

        Returns:
            This rank's mean loss, and the loss sum, correct count and samples over every rank.
        """
        choosing = self.stages.choose and self.step + 1 - self._began == auto.TRACED_STEP
        self.timer.begin_step(trace=self.step + 1 in self._traced_steps or choosing)
        self.net.train()
        # BatchNorm statistics move in the forward pass: a skipped step puts them back.
        self._buffers = [b.detach().clone() for b in self.model.buffers()]
        # On the device, read once the step is decided: a read per micro-batch would stall a GPU's queue.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        sync = registry.GRAD_SYNCS.get("overlap")
        if self.kfac:  # a grad sync may average differently on a step that sends factors (kfac.grad_sync=between)
            routes = (self.kfac.grad_owned, self.kfac.rebuilt())
            sync = self.kfac.stages.grad_sync.for_step(self.kfac.sends_factors(), *routes)
        correct, samples = torch.zeros_like(loss_sum), 0
        for i, (x, y) in enumerate(batches):
            x = x.to(self.device, self.dtype, non_blocking=True, memory_format=self.memory_format)
            y = y.to(self.device, non_blocking=True)
            # Gradients are averaged over ranks once: in the step's last backward pass, or after it (deferred).
            with sync.backward(self.backend, self.net, i == len(batches) - 1):
                with self.timer.compute("forward"), self.precision.autocast():
                    out = self._forward(x)
                    loss = cross_entropy(out, y, self.cfg.data.name, label_smoothing=self.cfg.train.label_smoothing)
                with self.timer.compute("backward"):
                    self.precision.scale(loss if len(batches) == 1 else loss / len(batches)).backward()
            loss_sum += loss.detach().double() * y.shape[0]
            correct += (out.detach().argmax(1) == y).sum()
            samples += y.shape[0]
        with self.timer.span("GradComm"):
            sync.finish(self.backend, self.optimizer)
        self.precision.unscale(self.optimizer)  # K-FAC and every check see the true gradients
        lr = self.optimizer.param_groups[0]["lr"]
        gradients = sync.gradients(self.backend, list(self.model.parameters()))
        # Averaged gradients are the same on every rank: every rank makes the same choice here (deferred
        # gradients are not averaged yet; their preconditioned form is checked below).
        usable = sync.usable(self.backend, self._gradients_finite) and math.isfinite(lr)
        if self.kfac and usable:
            self.kfac.step(lr, gradients)
            usable = self._gradients_finite()  # what is applied: the preconditioned gradients
        elif self.kfac:
            self.kfac.skip_step(gradients)  # its collectives still run: every rank drops this step's factors
        skip, totals = self._agree_to_skip(usable, torch.stack([loss_sum, correct, loss_sum.new_tensor(samples)]))
        value = float(loss_sum) / samples  # decided above: the device has finished the step's losses
        self.precision.update(skip)
        if skip:
            self.timer.end_step()  # a skipped step is not timed, and its time is no other step's
            return value, totals
        if self.cfg.optim.clip_grad_norm > 0:  # on what is applied; the same on every rank (averaged)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip_grad_norm)
        self.backend.optimizer_step(self.optimizer)
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        self._next_step()
        parts = self.timer.end_step(grad_launch=self.backend.last_grad_launch)
        self.report.step_timed(self.step, parts)
        if self.timer.tracing:
            with self.timer.outside():
                self._traced(parts, write=self.step in self._traced_steps, choose=choosing)
        return value, totals

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

    def _gradients_finite(self) -> bool:
        return all_finite([p.grad for p in self.model.parameters() if p.grad is not None])

    def _next_step(self) -> None:
        """Clear the gradients and advance the schedule and the step count (a skipped step too)."""
        self.optimizer.zero_grad()  # set_to_none is the default (and all Horovod accepts)
        with warnings.catch_warnings():
            # A skipped first step advances the schedule before any optimizer step, on purpose.
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler", UserWarning)
            self.scheduler.step()
        self.step += 1

    def _agree_to_skip(self, finite_update: bool, stats: Tensor) -> tuple[bool, Tensor]:
        """Agree with every rank whether to skip this step (non-finite loss or update) and whether to stop.

        One small all-reduce a step, which also sums ``stats`` (the metrics to log) over ranks: a
        skipped step updates nothing on any rank, so ranks never diverge. Too many skips in a
        row end training with a clear message, and so does a skip whose cause is already in the
        parameters (an earlier update overflowed).

        Args:
            finite_update: Whether this rank's update is finite.
            stats: This rank's loss sum, correct predictions and samples (float64, on the device);
                a non-finite loss sum is a non-finite loss.

        Returns:
            Whether the step is skipped, and ``stats`` summed over ranks (on the CPU).
        """
        bad_loss = ~torch.isfinite(stats[0])
        bad = torch.logical_or(bad_loss, torch.tensor(not finite_update, device=stats.device))
        head = torch.stack([bad.double(), stats.new_tensor(float(self.stop_requested)), bad_loss.double()])
        flags = self.backend.allreduce_sum(torch.cat([head, stats])).cpu()  # the step's one read of the device
        totals = flags[3:]
        if flags[1] > 0:
            self.stopped_by = self.stop_requested or signal.SIGTERM
        if flags[0] == 0:
            self.nonfinite_in_row = 0
            return False, totals
        # float16's gradients overflow while the loss scale finds its level: the scaler's business, not a fault.
        scaler_skip = self.precision.scaler is not None and flags[2] == 0
        self.nonfinite_in_row += 0 if scaler_skip else 1
        self.skipped_steps += 1
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), self._buffers, strict=True):
                buffer.copy_(saved)
        self._next_step()
        params, limit = list(self.model.parameters()), self.cfg.train.max_nonfinite
        skipped(params, self.step, bool(scaler_skip), int(flags[0]), self.nonfinite_in_row, limit)
        return True, totals

    def _traced(self, parts: dict[str, float], write: bool, choose: bool) -> None:
        """Gather the traced step's events from every rank: for rank 0's run log, and for ``kfac.variant=auto``."""
        events = self.backend.gather_objects(self.timer.events)
        layers = self.kfac.layers if self.kfac else []
        if write:
            self.report.timeline(events, layers, parts, self.step, self.world, self.stages.inverse)
        if choose and self.kfac is not None and self.kfac.profile is not None:
            batch, method = self.cfg.data.batch_size, self.stages.inverse
            traced = layer_profile(events, layers, parts, self.world, batch, method) if self.rank == 0 else None
            self.variant, self.stages = auto.switch(self.kfac, traced, self.cfg, self.backend, build.stages)

    def _evaluate(self, epoch: float) -> None:
        seconds = self.train_seconds
        with self._not_training(), torch.no_grad():
            self._evaluate_now(epoch, seconds)

    def _evaluate_now(self, epoch: float, seconds: float) -> None:
        record = {"epoch": epoch, "step": self.step, "seconds": round(seconds, 3)}
        for suffix, net in (("", self.net), ("_ema", self.ema)):
            if net is None:
                continue
            net.eval()
            sums = torch.zeros(3, dtype=torch.float64, device=self.device)
            for x, y in self.val_loader:
                x, y = x.to(self.device, self.dtype, memory_format=self.memory_format), y.to(self.device)
                with self.precision.autocast():
                    out = net(x).float()
                sums += torch.stack(
                    [
                        cross_entropy(out, y, self.cfg.data.name, reduction="sum").double(),
                        (out.argmax(1) == y).sum().double(),
                        torch.tensor(float(y.shape[0]), dtype=torch.float64, device=self.device),
                    ]
                )
            total = self.backend.allreduce_sum(sums).cpu()
            n = max(float(total[2]), 1.0)
            record |= {f"val_loss{suffix}": float(total[0]) / n, f"val_acc{suffix}": float(total[1]) / n}
        self.history.append(record)
        self.report.evaluation(record)

    def _log_train(self, total: Tensor) -> None:
        """Log the training metrics summed over ranks since the last log (no collective: the step made them)."""
        if total[2] > 0:
            lr = self.optimizer.param_groups[0]["lr"]
            clip = self.kfac.mean_clip_scale() if self.kfac else None
            self.report.train_scalars(self.step, float(total[0] / total[2]), float(total[1] / total[2]), lr, clip)
