"""The training loop: data, forward/backward, K-FAC step, optimizer, evaluation, checkpoints, logs."""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import warnings
from collections.abc import Iterable, Iterator
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from kfacflow import registry
from kfacflow.comm.base import Backend
from kfacflow.data.checks import cross_entropy, shown
from kfacflow.models.checks import explained
from kfacflow.running import build, checkpointing
from kfacflow.running.build import Training
from kfacflow.running.consistency import check_replicas, gradients_finite, skipped
from kfacflow.running.evaluation import evaluate, inputs, moving_average
from kfacflow.running.precision import MixedPrecision
from kfacflow.running.records import RunRecords
from kfacflow.running.runlog import RunLog
from kfacflow.running.step_verdict import agree
from kfacflow.running.timeline import layer_profile, traced_steps
from kfacflow.simulation import auto
from kfacflow.timing import StepTimer

logger = logging.getLogger(__name__)


def micro_batches(loader: Iterable[tuple[Tensor, Tensor]], k: int) -> Iterator[list[tuple[Tensor, Tensor]]]:
    """Yield the ``k`` micro-batches of each step of the epoch (an incomplete last group is dropped)."""
    batches = iter(loader)
    while len(group := list(islice(batches, k))) == k:
        yield group


class Trainer:
    """Trains what :func:`kfacflow.running.build.training` built from a recipe.

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
        self.info = built.info
        self.report = RunLog(cfg, run_dir, self.rank, self.world)
        self.precision = MixedPrecision(cfg.train.amp, self.device, cfg.train.loss_scale)
        if self.kfac:
            self.kfac.grad_scaler = self.precision.scaler
        self.ema = moving_average(self.model, cfg.train.ema)
        """The moving average of the weights (``train.ema``); every rank keeps the same one."""
        self.step = 0
        self.records = RunRecords(cfg.train, self.device)
        """What the run has done over every process of it (``summary.json``; carried by the checkpoint)."""
        self.stop_requested = 0
        """Signal number a handler set: stop after the current step (every rank agrees on when)."""
        self.stopped_by = 0
        self.nonfinite_in_row = 0
        self._buffers: list[Tensor] = []
        self._saved = (-1, 0)
        """(step, evaluations) of the newest checkpoint this process wrote or resumed from."""
        if built.resume_state is not None:
            checkpointing.restore(self, built.resume_state)
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
        """Whether every step of the run's budget is done."""
        return self.step >= self.total

    @property
    def nothing_to_do(self) -> bool:
        """Whether a resumed run is over: its budget done and evaluated, or its target (``train.stop_at_*``) reached."""
        return (self.finished and self.evaluated) or self.records.reached is not None

    @property
    def history(self) -> list[dict[str, float]]:
        """The run's evaluations, oldest first."""
        return self.records.history

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (non-finite loss or update), over resumes."""
        return self.records.skipped_steps

    @property
    def repaired(self) -> int:
        """Parameter tensors restored from rank 0's so far, over resumes (see kfacflow.running.consistency)."""
        return self.records.repaired

    @property
    def evaluated(self) -> bool:
        """Whether the validation set was evaluated after the current step."""
        return self.records.evaluated(self.step)

    # --- checkpoints --------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Check the replicas, then write a checkpoint (collective: rank 0 writes, every rank learns the outcome).

        Raises:
            TrainingError: If the parameters are non-finite (nothing is written).
            StorageError: On every rank, if rank 0 could not write it (the previous ones stay).
        """
        with self.records.paused(), self.timer.outside():  # out of every step and of the training seconds
            self.records.repaired += check_replicas(self.model, self.optimizer, self.backend, self.step)
            if self.cfg.train.save:  # every rank alike: the state is gathered collectively
                checkpointing.save(self)
            self._saved = (self.step, len(self.history))

    # --- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``train.steps`` or ``train.epochs``; return the summary (all ranks).

        A resumed run that is already finished only runs its final evaluation if that is missing.
        However training ends (its budget, its target, a signal, an error), the run's records end
        complete: the steps since the last training row get one, and every timed step its row.
        """
        self.records.start()
        self.report.open(self.step, self.total, self.history, logged=not self.records.interval[2] > 0)
        try:
            self._train()
            if self.finished and not self.evaluated and not self.stopped_by:
                self._evaluate(self.step / self.steps_per_epoch)  # a resumed run stopped before its final evaluation
            if self._saved != (self.step, len(self.history)):
                self.checkpoint()  # before the last row: a resume takes the steps since the previous one again
            else:
                self.records.repaired += check_replicas(self.model, self.optimizer, self.backend, self.step)
        except BaseException:
            with contextlib.suppress(Exception):  # the error that ended training is the one to report
                self._close_records()
            raise
        self._close_records()
        return self.records.summary(self)

    def _close_records(self) -> None:
        self._log_train()
        self.report.close()

    def _train(self) -> None:
        every = self.cfg.train.eval_every_steps
        while self.step < self.total and self.records.reached is None:
            epoch, offset = divmod(self.step, self.steps_per_epoch)
            self.sampler.set_epoch(epoch)
            self.sampler.skip = offset * self.cfg.data.batch_size * self.accumulate
            if offset == 0:  # a resumed epoch goes on with the sums its checkpoint kept
                self.records.epoch.zero_()
            for batches in micro_batches(self.loader, self.accumulate):
                loss, totals = self._train_step(batches)
                self.records.add(totals)
                self.report.advance(loss, epoch + 1)
                if self.step % self.cfg.train.log_every == 0 or self.step == self.total:
                    self._log_train()
                if every and self.step % every == 0 and self.step < self.total:
                    self._evaluate(self.step / self.steps_per_epoch)
                if self.cfg.train.checkpoint_every and self.step % self.cfg.train.checkpoint_every == 0:
                    self.checkpoint()
                if self.step >= self.total or self.step % self.steps_per_epoch == 0 or self.stopped_by:
                    break
                if every and self.step % every == 0 and self.records.reached is not None:
                    break
            if self.stopped_by:
                break
            done_epoch = self.step % self.steps_per_epoch == 0
            last = self.step >= self.total
            if (last or (done_epoch and (epoch + 1) % self.cfg.train.eval_every == 0)) and not self.evaluated:
                self._evaluate(epoch + 1 if done_epoch else self.step / self.steps_per_epoch)
            if done_epoch and not self.cfg.train.checkpoint_every and not last:
                self.checkpoint()

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
            x = inputs(x, self.device, self.dtype, self.memory_format)
            y = y.to(self.device, non_blocking=True)
            # Gradients are averaged over ranks once: in the step's last backward pass, or after it (deferred).
            with sync.backward(self.backend, self.net, i == len(batches) - 1):
                with self.timer.compute("forward"), self.precision.autocast():
                    out = self._forward(x)
                    loss = cross_entropy(out, y, self.cfg.data.name, label_smoothing=self.cfg.train.label_smoothing)
                with self.timer.compute("backward"):
                    self.precision.scale(loss if len(batches) == 1 else loss / len(batches)).backward()
            loss_sum += loss.detach().double() * y.numel()  # a language model's loss is a mean over tokens
            correct += (out.detach().argmax(-1) == y).sum()
            samples += y.numel()
        with self.timer.span("GradComm"):
            sync.finish(self.backend, self.optimizer)
        self.precision.unscale(self.optimizer)  # K-FAC and every check see the true gradients
        lr = self.optimizer.param_groups[0]["lr"]
        gradients = sync.gradients(self.backend, list(self.model.parameters()))
        # Averaged gradients are the same on every rank: every rank makes the same choice here (deferred
        # gradients are not averaged yet; their preconditioned form is checked below).
        usable = sync.usable(self.backend, partial(gradients_finite, self.model)) and math.isfinite(lr)
        if self.kfac and usable:
            self.kfac.step(lr, gradients)
            usable = gradients_finite(self.model)  # what is applied: the preconditioned gradients
        elif self.kfac:
            self.kfac.skip_step(gradients)  # its collectives still run: every rank drops this step's factors
        skip, totals = self._agree_to_skip(usable, torch.stack([loss_sum, correct, loss_sum.new_tensor(samples)]))
        value = float(loss_sum) / samples  # decided above: the device has finished the step's losses
        self.precision.update(skip)
        if skip:
            self.timer.end_step()  # a skipped step is not timed, and its time is no other step's
            return value, totals
        clipped = self.kfac is not None and self.kfac.updates.owned is not None  # by the owners' step
        if self.cfg.optim.clip_grad_norm > 0 and not clipped:  # on what is applied; the same on every rank
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip_grad_norm)
        self.backend.optimizer_step(self.optimizer)
        self.backend.sync_buffers(self.model)  # rank 0's statistics, under every grad sync (DDP's broadcast is off)
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        self._next_step()
        parts = self.timer.end_step(grad_launch=self.backend.last_grad_launch)
        self.records.times.add(parts)
        self.report.step_timed(self.step, parts)
        if self.timer.tracing:
            with self.timer.outside():
                self._traced(parts, write=self.step in self._traced_steps, choose=choosing)
        return value, totals

    def _forward(self, x: Tensor) -> Tensor:
        """Run the model; an error it raises that the user can mend ends in one line (:func:`.explained`)."""
        try:
            return self.net(x)  # type: ignore[no-any-return]
        except (RuntimeError, ValueError, AssertionError) as err:
            data = f"{shown(self.info)}, data.batch_size={self.cfg.data.batch_size}"
            raise explained(err, self.cfg.model.name, data, self.step <= self._began) from None

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

        A skipped step updates nothing on any rank (:func:`~kfacflow.running.step_verdict.agree`). Too many skips in a
        row end training with a clear message, and so does a skip whose cause is already in the parameters (an
        earlier update overflowed).

        Returns:
            Whether the step is skipped, and ``stats`` summed over ranks (on the CPU).
        """
        verdict = agree(self.backend, finite_update, stats, self.stop_requested)
        if verdict.stop:
            self.stopped_by = self.stop_requested or signal.SIGTERM
        if not verdict.skip:
            self.nonfinite_in_row = 0
            return False, verdict.totals
        # float16's gradients overflow while the loss scale finds its level: the scaler's business, not a fault.
        scaler_skip = self.precision.scaler is not None and verdict.loss_finite
        self.nonfinite_in_row += 0 if scaler_skip else 1
        self.records.skipped_steps += 1
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), self._buffers, strict=True):
                buffer.copy_(saved)
        self._next_step()
        params, limit = list(self.model.parameters()), self.cfg.train.max_nonfinite
        skipped(params, self.step, scaler_skip, verdict.bad_ranks, self.nonfinite_in_row, limit)
        return True, verdict.totals

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
        record: dict[str, float] = {"epoch": epoch, "step": self.step, "seconds": round(self.records.train_seconds, 3)}
        nets, data = {"": self.net, "_ema": self.ema}, (self.cfg.data.name, self.memory_format, self.dtype)
        with self.records.paused(), self.timer.outside(), torch.no_grad():  # out of every step and the seconds
            record |= evaluate(nets, self.val_loader, self.backend, self.precision, *data, self.info.tokens)
        self.history.append(record)
        self.report.evaluation(record)

    def _log_train(self) -> None:
        """Log the training metrics summed over ranks since the last log (no collective: the step made them)."""
        total = self.records.interval
        if total[2] > 0:
            lr = self.optimizer.param_groups[0]["lr"]
            clip = self.kfac.mean_clip_scale() if self.kfac else None
            self.report.train_scalars(self.step, float(total[0] / total[2]), float(total[1] / total[2]), lr, clip)
            total.zero_()
