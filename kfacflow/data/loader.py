"""Distributed data loading: per-epoch shuffled shards that can resume mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """``DistributedSampler`` that can skip the batches an interrupted epoch already used.

    The order depends only on the seed and the epoch, never on the world size, so ``P``
    workers with batch ``b`` see exactly the samples one worker with batch ``P b`` sees.
    """

    skip = 0
    """Samples of this rank's shard to skip in the next epoch (set on resume, then cleared)."""

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.skip :]
        self.skip = 0
        return iter(indices)


class ShardSampler(Sampler[int]):
    """Every ``world``-th sample from ``rank``, in order, with no padding (exact evaluation)."""

    def __init__(self, length: int, rank: int, world: int) -> None:
        self.indices = list(range(rank, length, world))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def train_loader(
    dataset: Dataset,
    batch: int,
    rank: int,
    world: int,
    seed: int,
    workers: int,  # type: ignore[type-arg]
) -> tuple[DataLoader, ResumableSampler]:  # type: ignore[type-arg]
    """Return the training loader (full batches only) and its sampler."""
    sampler = ResumableSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=False)
    loader = DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        drop_last=True,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=workers > 0,
    )
    return loader, sampler


def eval_loader(dataset: Dataset, batch: int, rank: int, world: int, workers: int) -> DataLoader:  # type: ignore[type-arg]
    """Return an evaluation loader over this rank's unpadded shard."""
    sampler = ShardSampler(len(dataset), rank, world)  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers)
