"""Inverse placement: the paper's Fig. 5 cases, 2L < P, and CT/NCT from the models."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kfacflow import UserError
from kfacflow.kfac.stages.placement import (
    EVERY_RANK,
    by_layer,
    gathers,
    layer,
    layer_order,
    lbp,
    local,
    precondition_cost,
    round_robin,
    update_buckets,
)
from kfacflow.kfac.stages.update_plan import LayerWork, layer_work
from kfacflow.perf import InverseModel, LinearModel, Profile


def profile(bcast_alpha: float, bcast_beta: float = 0.0) -> Profile:
    # Inverse time d^3 * 1e-3 s: dims 10, 9, 8, 7 cost 1.0, 0.729, 0.512, 0.343 s.
    return Profile(
        allreduce=LinearModel(0.0, 0.0),
        broadcast=LinearModel(bcast_alpha, bcast_beta),
        inverse=InverseModel("cubic", 0.0, 1e-3),
    )


DIMS = [10, 7, 8, 9]  # T1..T4 in the preconditioner's order
SIZES = [d * (d + 1) // 2 for d in DIMS]


def test_fig5a_sequential_placement_is_round_robin() -> None:
    assert round_robin(DIMS, SIZES, 2, None) == [0, 1, 0, 1]
    # loads: rank 0 inverts 10 and 8 (1.512 s), rank 1 inverts 7 and 9 (1.072 s): unbalanced.


def test_fig5b_load_balanced_all_communicated() -> None:
    # Free broadcasts: every tensor is CT. Largest first: 10 -> r0 (1.0), 9 -> r1 (0.729),
    # 8 -> r1 (1.241), 7 -> r0 (1.343).
    assert lbp(DIMS, SIZES, 2, profile(0.0)) == [0, 0, 1, 1]


def test_fig5c_load_balanced_with_an_nct() -> None:
    # A broadcast costs 0.4 s: inverting 7 (0.343 s) is cheaper than sending it -> NCT.
    # 10 -> r0 (1.4), 9 -> r1 (1.129), 8 -> r1 (2.041), 7 on every rank.
    assert lbp(DIMS, SIZES, 2, profile(0.4)) == [0, EVERY_RANK, 1, 1]


def test_ct_nct_follows_the_models() -> None:
    # Broadcast dearer than every inverse: all NCT (the D-KFAC placement).
    assert lbp(DIMS, SIZES, 2, profile(5.0)) == [EVERY_RANK] * 4
    # Size-dependent broadcast: 0.3 + 0.01 m; d=10: comp 1.0 vs comm 0.85 -> CT;
    # d=7: 0.343 vs 0.58 -> NCT; d=8: 0.512 vs 0.66 -> NCT; d=9: 0.729 vs 0.75 -> NCT.
    assert lbp(DIMS, SIZES, 2, profile(0.3, 0.01)) == [0, EVERY_RANK, EVERY_RANK, EVERY_RANK]


def test_fewer_tensors_than_ranks() -> None:
    dims, sizes = [10, 9], [55, 45]
    assert round_robin(dims, sizes, 4, None) == [0, 1]
    assert lbp(dims, sizes, 4, profile(0.0)) == [0, 1]


def test_single_rank_and_local() -> None:
    assert lbp(DIMS, SIZES, 1, profile(0.0)) == [EVERY_RANK] * 4
    assert round_robin(DIMS, SIZES, 1, None) == [EVERY_RANK] * 4
    assert local(DIMS, SIZES, 8, None) == [EVERY_RANK] * 4


def test_lbp_without_models_is_a_user_error() -> None:
    with pytest.raises(UserError, match="kfac.profile"):
        lbp(DIMS, SIZES, 2, None)


def test_schedule_sends_communicated_inverses_first_by_estimated_finish() -> None:
    from kfacflow.kfac.stages.placement import schedule

    # Fig. 5c placement: T1 (10) on r0, T3 (8) and T4 (9) on r1, T2 (7) everywhere.
    owners = [0, EVERY_RANK, 1, 1]
    order = schedule(DIMS, owners, 2, profile(0.4))
    # r1 inverts 9 (done at 0.729 s) before 8 (1.241 s); r0 finishes 10 at 1.0 s; the NCT comes last.
    assert order == [3, 0, 2, 1]
    assert schedule(DIMS, [EVERY_RANK] * 4, 2, None) == [0, 1, 2, 3]


def test_inverse_phase_queues_broadcasts_on_one_link() -> None:
    from kfacflow.kfac.stages.placement import inverse_phase, schedule

    # Fig. 5c placement, broadcasts of 0.4 s on one link, in the schedule's order [T4, T1, T3, T2].
    owners = [0, EVERY_RANK, 1, 1]
    costs, comms = [1.0, 0.343, 0.512, 0.729], [0.4] * 4
    busy, arrivals = inverse_phase(costs, comms, owners, schedule(DIMS, owners, 2, profile(0.4)), 2)
    # T4 leaves r1 at 0.729 and arrives at 1.129; T1 is ready at 1.0 but waits for the link until
    # 1.129 (Algorithm 1 counts it as arriving at 1.4); T3 is ready at 1.241, sent at 1.529.
    assert arrivals == pytest.approx([1.129, 1.529, 1.929, 0.0])
    assert busy == pytest.approx([1.343, 1.584])  # each rank then inverts the NCT T2


def test_link_aware_placement_keeps_a_factor_local_when_its_broadcast_would_queue() -> None:
    from kfacflow.kfac.stages.placement import link

    # Sending T3 (8) ends the phase at 1.929 (the link is busy); inverting it on both ranks ends
    # it at 1.855 (r0: 1.0 + 0.512 + 0.343); everything else only gets worse (see the test above).
    assert link(DIMS, SIZES, 2, profile(0.4)) == [0, EVERY_RANK, EVERY_RANK, 1]
    assert link(DIMS, SIZES, 2, profile(0.0)) == lbp(DIMS, SIZES, 2, profile(0.0))  # free links: nothing to fix
    assert link(DIMS, SIZES, 1, profile(0.4)) == [EVERY_RANK] * 4
    with pytest.raises(UserError, match="kfac.placement=link"):
        link(DIMS, SIZES, 2, None)


def test_layer_placement_gives_whole_layers_and_keeps_cheap_ones_everywhere() -> None:
    # Two layers, (A 10, G 7) and (A 8, G 9). Work: inverses plus a preconditioning costed as an
    # inversion of side (a g (a + g))^(1/3): 1.0 + 0.343 + 1.19 = 2.533 s and 0.512 + 0.729 + 1.224 = 2.465 s.
    assert layer(DIMS, [70, 70, 72, 72], 2, profile(0.0)) == [0, 0, 1, 1]
    # A 2.5 s broadcast: the second layer is cheaper to compute on every rank than to send.
    assert layer(DIMS, [70, 70, 72, 72], 2, profile(2.5)) == [0, 0, EVERY_RANK, EVERY_RANK]
    assert layer(DIMS, [70, 70, 72, 72], 1, profile(0.0)) == [EVERY_RANK] * 4
    with pytest.raises(UserError, match="kfac.placement=layer needs performance models"):
        layer(DIMS, [70, 70, 72, 72], 2, None)


def test_layer_placement_by_a_steps_work_sends_updates_while_the_owners_compute() -> None:
    work = LayerWork((1.0, 0.9, 0.3, 0.2), (0.0, 0.0, 0.0, 0.0), 10)  # preconditioning alone
    sizes = [100, 100, 100, 100, 100, 100, 400, 400]
    dims = [10, 7, 8, 9, 2, 2, 3, 3]
    # Costliest first to the least loaded: 1.0 -> r0, 0.9 -> r1, 0.3 -> r1 (1.2), 0.2 -> r0 (1.2). Sending
    # overlaps the work, so however dear a broadcast, no layer is shared while the link keeps up.
    assert layer(dims, sizes, 2, profile(0.0), work) == [0, 0, 1, 1, 1, 1, 0, 0]
    assert layer(dims, sizes, 2, profile(0.3), work) == [0, 0, 1, 1, 1, 1, 0, 0]  # sends 0.6 / 0.6 s < 1.2 s
    # At 5 ms an element rank 0 sends 0.5 + 2.0 s against 1.2 s of work: the link bounds the step. Of its
    # layers the last sends 10 s per second of work (the first 0.5): every rank does it, nothing is sent,
    # and rank 1's work grows to 1.4 s, more than either rank's 1.0 / 0.5 s of sends.
    assert layer(dims, sizes, 2, profile(0.0, 0.005), work) == [0, 0, 1, 1, 1, 1, EVERY_RANK, EVERY_RANK]
    # Beyond two ranks every update shares one link: at P = 3 the four 0.3 s sends (1.2 s) outlast rank 0's
    # 1.0 s of work, so rank 2's costlier sender per second of work (0.2 s of work) goes to every rank.
    assert layer(dims, sizes, 3, profile(0.3), work) == [0, 0, 1, 1, 2, 2, EVERY_RANK, EVERY_RANK]
    assert layer(dims, sizes, 1, profile(0.0), work) == [EVERY_RANK] * 8


def test_a_steps_work_counts_rows_and_a_share_of_the_inversions() -> None:
    # The recipe's method inverts at 0.5e-3 d^3 s; a dense inverse (what preconditioning's products cost
    # per multiply-add) at 1e-3 d^3 s.
    prof = Profile(LinearModel(0, 0), LinearModel(0, 0), InverseModel("cubic", 0.0, 5e-4))
    prof.methods["cholesky"] = InverseModel("cubic", 0.0, 1e-3)
    # (A 10, G 7): 10 * 7 * 17 = 1190 multiply-adds from the gradient; from 2 rows 2 (100 + 49 + 70) = 438.
    assert precondition_cost(10, 7, prof) == pytest.approx(0.595)
    assert precondition_cost(10, 7, prof, dense=True) == pytest.approx(1.19)
    assert precondition_cost(10, 7, prof, 2, dense=True) == pytest.approx(0.438)
    # Inverting both factors (0.5 + 0.1715 s) once in 10 steps.
    work = layer_work([10, 7, 8, 9], prof, [2, 0], 10)
    assert work.precondition == pytest.approx([0.438, 8 * 9 * 17 * 1e-3])
    assert work.invert == pytest.approx([0.5 + 0.1715, 0.256 + 0.3645])
    assert work.per_step() == pytest.approx([0.438 + 0.06715, 1.224 + (0.256 + 0.3645) / 10])
    assert not work.staggered and layer_work([10, 7], prof, None, 10, staggered=True).staggered


def test_a_period_waits_on_the_most_preconditioning_between_inversions_and_the_most_work_at_them() -> None:
    work = LayerWork((0.2, 0.9, 0.5, 0.5), (8.0, 1.0, 0.0, 0.0), 10)
    # Layers 0 and 2 on rank 0, 1 on rank 1, 3 on every rank.
    pre, inv = work.loads([0, 1, 0, EVERY_RANK], 2)
    assert pre == pytest.approx([1.2, 1.4]) and inv == pytest.approx([8.0, 1.0])
    # Nine steps wait on rank 1's 1.4 s of preconditioning, the inverting one on rank 0's 9.2 s.
    assert work.period(pre, inv) == pytest.approx(9 * 1.4 + 9.2)
    # Staggered, each step carries a tenth of the inversions: ten steps of rank 0's 1.2 + 0.8 s.
    assert replace(work, staggered=True).period(pre, inv) == pytest.approx(10 * 2.0)
    # What a period waits on: the most preconditioning (rank 3) and the most of both (rank 1); staggered,
    # the most of preconditioning and a tenth of the inversions (rank 2: 1.15 s against 1.1, 1.1 and 1.0 s).
    pre, inv = [1.0, 0.2, 1.05, 1.1], [0.0, 9.0, 1.0, 0.0]
    assert work.busiest(pre, inv) == {3, 1}
    assert replace(work, staggered=True).busiest(pre, inv) == {2}


def test_layers_are_balanced_between_inversions_and_at_them_not_on_a_steps_average() -> None:
    # A step's average: 1.0, 1.0, 0.5, 0.5 s. Costliest first to the least loaded: 0 -> r0, 1 -> r1,
    # 2 -> r0, 3 -> r1, 1.5 s each on average, but rank 0 inverts 8 s and rank 1 preconditions 1.4 s:
    # a period of 9 x 1.4 + 8.7 = 21.3 s. Swapping layers 0 and 3 (rank 0: 2 and 3, 1.0 s between
    # inversions; rank 1: 0 and 1, 1.1 s and 10.1 s at them) makes it 9 x 1.1 + 10.1 = 20.0 s, the least.
    work = LayerWork((0.2, 0.9, 0.5, 0.5), (8.0, 1.0, 0.0, 0.0), 10)
    dims, sizes = [10, 7, 8, 9, 2, 2, 3, 3], [100] * 8
    assert layer(dims, sizes, 2, profile(0.0), work) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert work.period(*work.loads([1, 1, 0, 0], 2)) == pytest.approx(20.0)
    # Staggered, each step carries its share of the inversions, and the average is what balances: 1.5 s each.
    assert layer(dims, sizes, 2, profile(0.0), replace(work, staggered=True)) == [0, 0, 1, 1, 0, 0, 1, 1]


def test_the_plan_places_layers_by_a_steps_work_only_between_inversions() -> None:
    from kfacflow.kfac.planning.plan import Choice, EngineCaps, make_plan
    from kfacflow.kfac.stages.inverse import DenseInverse
    from kfacflow.registry import PLACEMENTS

    layers = [(10, 7, 70), (8, 9, 72), (2, 2, 4), (3, 3, 9)]
    choice = Choice(PLACEMENTS.get("layer"), DenseInverse, update=True)

    def owners(**kwargs: object) -> list[int]:
        return list(make_plan(layers, choice, 2, profile(0.0), EngineCaps(), **kwargs).owners[::2])  # type: ignore[arg-type]

    # Every step, Algorithm 1 on whole layers: 2.533 s -> r0, 2.465 -> r1, 0.108 -> r1, 0.032 -> r0.
    assert owners() == [0, 1, 0, 1]
    # Inverting once in 10 steps: 1.19 + 0.1343 s, 1.224 + 0.1241 (the costliest now), 0.0016 + 0.016,
    # 0.054 + 0.0054: (8, 9) -> r0, (10, 7) -> r1, (3, 3) -> r1 (1.384), (2, 2) -> r0 (1.366).
    assert owners(inverse_every=10) == [1, 0, 0, 1]
    # (8, 9) from 2 rows a step (2 (64 + 81 + 72) = 434 multiply-adds): 0.558 s, so (10, 7) -> r0 and
    # everything else -> r1 (0.558 + 0.0594 + 0.0176 s).
    assert owners(inverse_every=10, rows=[0, 2, 0, 0]) == [0, 1, 1, 1]
    assert owners(rows=[0, 2, 0, 0]) == [0, 1, 0, 1]  # every step: as before


def test_by_layer_puts_both_factors_with_the_larger_communicated_one() -> None:
    assert by_layer(DIMS, [0, EVERY_RANK, EVERY_RANK, 1]) == [0, 0, 1, 1]
    assert by_layer(DIMS, [EVERY_RANK, 1, 0, 1]) == [1, 1, 1, 1]  # A 10 is an NCT: G's owner takes it
    assert by_layer(DIMS, [EVERY_RANK] * 4) == [EVERY_RANK] * 4


def test_layer_order_interleaves_owners_by_estimated_finish_and_puts_shared_layers_last() -> None:
    # Preconditioning estimates (1e-3 a g (a + g)): (10, 7) 1.19 s, (8, 9) 1.224 s, (2, 2) 0.016 s, (3, 3) 0.054 s.
    dims = [10, 7, 8, 9, 2, 2, 3, 3]
    # Rank 0 owns the first and third layers (costliest first: 1.19, then 1.206), rank 1 the second (1.224).
    assert layer_order(dims, [0, 0, 1, 1, 0, 0, EVERY_RANK, EVERY_RANK], 2, profile(0.0)) == [0, 2, 1, 3]


def test_update_buckets_fuse_only_where_one_allreduce_beats_the_broadcasts() -> None:
    def models(ar: tuple[float, float], bc: tuple[float, float]) -> Profile:
        return Profile(LinearModel(*ar), LinearModel(*bc), InverseModel("cubic", 0.0, 1e-3))

    order, elements = [3, 0, 1, 2, 4], [100, 200, 300, 400, 500]
    owners = [0, 1, 0, EVERY_RANK, 1]  # layer 3 is computed on every rank: never sent
    # All-reduce: 1 s + 1 ms/element; a bucket closes at 10 s of transfer (10,000 elements): never here.
    # One all-reduce of layers 0, 1, 2, 4 (1100 elements): 2.1 s, against 4 broadcasts of 1 s + 1 ms/element: 5.1 s.
    assert update_buckets(order, elements, owners, models((1.0, 1e-3), (1.0, 1e-3))) == [[0, 1, 2, 4]]
    # All-reduce start-up 0.05 s: a bucket closes at 500 elements. [0, 1, 2] in one all-reduce
    # (0.65 s, against 3 x 0.4 + 0.6 = 1.8 s of broadcasts); [4] alone is a broadcast.
    assert update_buckets(order, elements, owners, models((0.05, 1e-3), (0.4, 1e-3))) == [[0, 1, 2], [4]]
    # Start-ups cheap next to the all-reduce's doubled traffic (3.2 s against 4 x 0.2 + 1.1 s): each layer alone.
    assert update_buckets(order, elements, owners, models((1.0, 2e-3), (0.2, 1e-3))) == [[0], [1], [2], [4]]
    assert update_buckets(order, elements, owners, None) == [[0], [1], [2], [4]]
    # P = 3, layer 4 on rank 2. Broadcasts (4 x 0.25 + 1.1 s) cost what the all-reduce does (2.1 s): each
    # alone. Gathered from the owners (400, 200, 500 elements): 0.5 + 0.001 (1100 x 2/3 + 500) = 1.73 s.
    three, owned = models((1.0, 1e-3), (0.25, 1e-3)), [0, 1, 0, EVERY_RANK, 2]
    assert update_buckets(order, elements, owned, three, 3) == [[0], [1], [2], [4]]
    assert update_buckets(order, elements, owned, three, 3, gather=True) == [[0, 1, 2, 4]]
    assert gathers([0, 1, 2, 4], elements, owned, three, 3)
    assert not gathers([0, 1, 2, 4], elements, owners, models((1.0, 1e-3), (0.0, 0.0)), 2)  # never at P = 2


def test_measured_preconditioning_replaces_the_estimates_and_moves_layers() -> None:
    from kfacflow.kfac.planning.plan import Choice, EngineCaps, make_plan
    from kfacflow.kfac.stages.inverse import DenseInverse
    from kfacflow.registry import PLACEMENTS

    prof = profile(0.0)
    work = layer_work([10, 7, 8, 9], prof, None, 10, seconds=[None, 0.05])
    # Measured seconds stand for the preconditioning they measured; the inversions stay the profile's.
    assert work.precondition == pytest.approx([precondition_cost(10, 7, prof, dense=True), 0.05])
    assert work.invert == pytest.approx([1.0 + 0.343, 0.512 + 0.729])

    layers = [(10, 7, 70), (8, 9, 72), (2, 2, 4), (3, 3, 9)]
    choice = Choice(PLACEMENTS.get("layer"), DenseInverse, update=True)

    def owners(seconds: list[float | None] | None) -> list[int]:
        return list(make_plan(layers, choice, 2, prof, EngineCaps(), inverse_every=10, seconds=seconds).owners[::2])

    # Estimated (as above): (8, 9) -> r0, (10, 7) -> r1, (3, 3) -> r1, (2, 2) -> r0.
    assert owners(None) == owners([None] * 4) == [1, 0, 0, 1]
    # (2, 2) measured at 2.0 s a step, the costliest: it takes rank 0 with (3, 3) (2.054 s between
    # inversions), (8, 9) and (10, 7) go to rank 1 (2.414 s); no move or swap shortens that period.
    assert owners([None, None, 2.0, None]) == [1, 1, 0, 0]


def test_layers_move_to_a_measured_placement_only_where_it_saves_a_share_of_the_period() -> None:
    from kfacflow.kfac.planning.measured import GAIN, worth_moving

    work = LayerWork((0.2, 0.9, 0.5, 0.5), (8.0, 1.0, 0.0, 0.0), 10)
    # As above: 21.3 s a period placed on a step's average, 20.0 s once balanced, 6 % less: moved.
    assert worth_moving(work, [0, 1, 0, 1], [1, 1, 0, 0], 2) == (pytest.approx(21.3), pytest.approx(20.0), True)
    # The same placement with the ranks' names swapped saves nothing: the layers stay where they are.
    assert worth_moving(work, [0, 0, 1, 1], [1, 1, 0, 0], 2)[2] is False
    assert worth_moving(work, [1, 1, 0, 0], [1, 1, 0, 0], 2)[2] is False
    # Saving less than GAIN of the period: a third layer's 6 ms beside the second's 1 s instead of with the
    # fourth's 2 ms beside the first's, 10.08 -> 10.06 s.
    near = LayerWork((1.0, 1.0, 0.006, 0.002), (0.0, 0.0, 0.0, 0.0), 10)
    old, new, taken = worth_moving(near, [0, 1, 0, 0], [0, 1, 1, 0], 2)
    assert (old, new) == (pytest.approx(10.08), pytest.approx(10.06)) and new > old * (1 - GAIN) and not taken
