"""Pieces to and from their owners: the layout by hand, the costs, and real gloo groups of three."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import run_in_gloo

from kfacflow.comm import scatter
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import DistConfig
from kfacflow.kfac.stages.contracts import EVERY_RANK
from kfacflow.kfac.stages.fusion import SCATTER, Routing
from kfacflow.perf import LinearModel

COUNTS = [[3, 0, 5], [0, 0, 7], [4, 4, 4], [1, 9, 0], [0, 0, 0], [2, 0, 0]]


def test_splits_by_hand() -> None:
    # 8 elements in chunks of 3: rank 0 owns [0, 3), rank 1 nothing, rank 2 [3, 8).
    # Chunk 0 = [0, 3) all rank 0's; chunk 1 = [3, 6) rank 2's; chunk 2 = [6, 8) rank 2's (and one pad).
    assert scatter.chunk_size(8, 3) == 3
    assert scatter.splits([3, 0, 5], 0) == ([3, 0, 0], [3, 0, 0])
    assert scatter.splits([3, 0, 5], 1) == ([0, 0, 3], [0, 0, 0])
    assert scatter.splits([3, 0, 5], 2) == ([0, 0, 2], [0, 3, 2])
    # Every piece leaves its owner whole, and every chunk is accounted for.
    for counts in COUNTS:
        for rank in range(3):
            from_chunk, to_chunk = scatter.splits(counts, rank)
            assert sum(to_chunk) == counts[rank]
            assert sum(from_chunk) <= scatter.chunk_size(sum(counts), 3)


def test_cost_and_when_it_pays() -> None:
    bc, ar = LinearModel(1.0, 0.01), LinearModel(1.0, 0.02)
    # Two start-ups; (P - 1) / P of the buffer, then the larger of the largest piece and a chunk.
    assert scatter.cost(bc, [100, 200, 300]) == pytest.approx(2.0 + 0.01 * (400 + 300))
    assert scatter.pays(ar, bc, [100, 200, 300])  # 9.0 s against 13.0 s
    assert not scatter.pays(ar, LinearModel(5.0, 0.01), [100, 200, 300])  # 17.0 s
    assert not scatter.pays(ar, LinearModel(0.0, 0.0), [100, 200])  # never at P = 2


def test_direct_cost_and_when_it_pays() -> None:
    bc, ar = LinearModel(1.0, 0.01), LinearModel(1.0, 0.02)
    # P - 1 start-ups; the busiest rank's larger direction: rank 2 sends 300 and receives 2 x 300 = 600.
    assert scatter.direct_cost(bc, [100, 200, 300]) == pytest.approx(2.0 + 0.01 * 600)
    # At P = 2 each rank sends the other's piece as it receives its own: the larger piece, once.
    assert scatter.direct_cost(bc, [100, 300]) == pytest.approx(1.0 + 0.01 * 300)
    assert scatter.pays(ar, bc, [100, 300], direct=True)  # 4.0 s against 9.0 s
    assert not scatter.pays(ar, bc, [100, 300])  # the two steps never at P = 2
    assert not scatter.pays(ar, LinearModel(1.0, 0.05), [100, 300], direct=True)  # 16.0 s
    assert not scatter.pays(ar, bc, [400], direct=True)  # one rank: nothing to send


def test_routing_reduces_a_group_to_all_its_owners_at_once() -> None:
    owners = {"a": 2, "b": 0, "c": EVERY_RANK, "d": 1}
    sizes = {"a": 10, "b": 10, "c": 10, "d": 10}
    ar, bc = LinearModel(1.0, 0.0), LinearModel(0.4, 0.0)
    # Three reductions (1.2 s) or one all-reduce (1.0 s) against two start-ups (0.8 s): the factors in rank order.
    assert Routing(owners, 3, ar, bc, scatters=True).parts(["a", "b", "d"], sizes) == [(SCATTER, ["b", "d", "a"])]
    assert Routing(owners, 3, ar, bc, scatters=False).parts(["a", "b", "d"], sizes) == [(None, ["a", "b", "d"])]
    # With an NCT, all-reduced beside them: 0.8 + 2 s against 1.2 + 2 s of reductions and 5 s of one all-reduce.
    assert Routing(owners, 3, LinearModel(1.0, 0.1), bc, scatters=True).parts(["a", "c", "b", "d"], sizes) == [
        (SCATTER, ["b", "d", "a"]),
        (None, ["c"]),
    ]
    # One owner: its reduction; two ranks: the two directions at once, never the two steps.
    assert Routing(owners, 3, ar, bc, scatters=True).parts(["a"], sizes) == [(2, ["a"])]
    assert Routing({"a": 0, "b": 1}, 2, ar, bc, scatters=True).parts(["a", "b"], sizes) == [(0, ["a"]), (1, ["b"])]


def _pieces(rank: int, world: int) -> bool:
    backend = TorchBackend(DistConfig(device="cpu"))
    try:
        # Gloo's reduce-scatter is no faster than its all-reduce: it sends each piece straight to its owner.
        assert backend.gathers and backend.direct and not backend.scatters
        for counts in COUNTS if world == 3 else [c[:2] for c in COUNTS]:
            total = sum(counts)
            flat = torch.arange(total, dtype=torch.float64) * (rank + 1) + 0.25
            start = sum(counts[:rank])
            ranks = world * (world + 1) // 2  # 1 + 2 (+ 3)
            want = (torch.arange(total, dtype=torch.float64) * ranks + 0.25 * world)[start : start + counts[rank]]
            # gloo's pieces sent to their owners, and the two steps NCCL runs (here on gloo)
            assert torch.equal(backend.reduce_to_owners_async(flat.clone(), counts).wait(), want), counts
            assert torch.equal(scatter.reduce_to_owners(flat.clone(), counts, rank, backend._group).wait(), want)
            piece = torch.randn(counts[rank], dtype=torch.float64) * 1e-300  # subnormals travel as they are
            every = torch.cat(backend.gather_objects(piece))
            assert torch.equal(backend.gather_async(piece, counts).wait(), every), counts
            # The default (an all-reduce) where an engine cannot move pieces alone: the same results.
            backend.reduces = backend.gathers = False
            assert torch.equal(backend.reduce_to_owners_async(flat.clone(), counts).wait(), want)
            assert torch.equal(backend.gather_async(piece, counts).wait(), every)
            backend.reduces = backend.gathers = True
        return True
    finally:
        backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_pieces_reach_their_owners_on_gloo_ranks(world: int) -> None:
    assert run_in_gloo(_pieces, world) == [True] * world


def _point_to_point(rank: int, world: int) -> bool:
    from kfacflow.comm import torch_dist

    torch_dist.P2P_CHUNK_BYTES = 64  # 8 float64 a chunk: the 21-element tensor goes in three
    backend = TorchBackend(DistConfig(device="cpu"))
    try:
        other = 1 - rank
        shapes = [(0,), (5,), (3, 7), (2, 2)]
        tags = [backend.reserve(torch.empty(shape, dtype=torch.float64)) for shape in shapes]
        assert tags == [0, 1, 2, 5]  # a tag a chunk, an empty tensor one; the same on every rank
        mine = [torch.randn(shape, dtype=torch.float64) for shape in shapes]
        theirs = backend.gather_objects(mine)[other]
        got = [torch.empty(shape, dtype=torch.float64) for shape in shapes]
        if rank == 0:  # every receive before the sends, in reverse order; the other rank sends first
            recvs = [backend.recv_async(got[i], other, tags[i]) for i in reversed(range(len(shapes)))]
            sends = [backend.send_async(mine[i], other, tags[i]) for i in range(len(shapes))]
        else:
            sends = [backend.send_async(mine[i], other, tags[i]) for i in range(len(shapes))]
            recvs = [backend.recv_async(got[i], other, tags[i]) for i in range(len(shapes))]
        for handle in sends + recvs:
            handle.wait()
        assert all(torch.equal(g, t) for g, t in zip(got, theirs, strict=True))
        # A reduction to one rank takes the next tags on every rank alike.
        total = torch.full((9,), float(rank + 1), dtype=torch.float64)
        backend.reduce_async(total, 1).wait()
        assert backend.reserve(torch.empty(1)) == 8 and (rank == 0 or torch.equal(total, torch.full((9,), 3.0)))
        return True
    finally:
        backend.close()


@pytest.mark.slow
def test_tensors_go_point_to_point_in_chunks_whatever_order_each_side_posts_in() -> None:
    assert run_in_gloo(_point_to_point, 2) == [True, True]


class _Recorded:
    """A work whose ``wait()`` is logged."""

    def __init__(self, work: Any, name: str, log: list[str]) -> None:
        self.work, self.name, self.log = work, name, log

    def wait(self) -> Any:
        self.log.append(f"wait {self.name}")
        return self.work.wait()

    def get_future(self) -> Any:
        return self.work.get_future()


class _OneStream:
    """torch.distributed over the real gloo group, run as NCCL runs a group: each collective done before the next.

    Gloo's threads may run two works at once, so here each finishes as it is posted (as on NCCL's one stream,
    where the next starts after it); what the caller posts and waits for, and in what order, is logged.
    """

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __getattr__(self, name: str) -> Any:
        real = getattr(dist, name)
        if not name.endswith("_single"):
            return real

        def post(*args: Any, **kwargs: Any) -> _Recorded:
            work = real(*args, **kwargs)
            work.wait()
            self.log.append(f"post {name}")
            return _Recorded(work, name, self.log)

        return post


def _chained(rank: int, world: int) -> dict[str, list[str]]:
    backend = TorchBackend(DistConfig(device="cpu"))
    logs: dict[str, list[str]] = {}
    try:
        assert not backend.in_order  # gloo: the host waits between the two
        counts = [3, 0, 5]
        flat = torch.arange(8, dtype=torch.float64) * (rank + 1)
        start = sum(counts[:rank])
        want = (torch.arange(8, dtype=torch.float64) * 6)[start : start + counts[rank]]
        piece = torch.full((counts[rank],), float(rank), dtype=torch.float64)
        every = torch.cat(backend.gather_objects(piece))
        real = scatter.dist
        for in_order in (False, True):
            log: list[str] = []
            scatter.dist = _OneStream(log)  # type: ignore[assignment]
            try:
                assert torch.equal(
                    scatter.reduce_to_owners(flat.clone(), counts, rank, backend._group, in_order).wait(), want
                )
                backend.in_order = in_order  # what TorchBackend sets on NCCL
                assert torch.equal(backend.gather_async(piece, counts).wait(), every)
            finally:
                scatter.dist = real
            logs[str(in_order)] = log
        return logs
    finally:
        backend.close()


@pytest.mark.slow
def test_chained_collectives_wait_between_on_gloo_only() -> None:
    for logs in run_in_gloo(_chained, 3):
        rs, a2a, ag = "reduce_scatter_single", "all_to_all_single", "all_gather_single"
        assert logs["False"] == [f"post {rs}", f"wait {rs}", f"post {a2a}", f"wait {a2a}"] + [
            f"post {a2a}",
            f"wait {a2a}",
            f"post {ag}",
            f"wait {ag}",
        ]
        # In posting order on one stream (NCCL): both posted before anything waits, so the compute stream
        # never waits for the group's stream between them.
        assert logs["True"] == [f"post {rs}", f"post {a2a}", f"wait {rs}", f"wait {a2a}"] + [
            f"post {a2a}",
            f"post {ag}",
            f"wait {a2a}",
            f"wait {ag}",
        ]
