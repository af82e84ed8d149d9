"""Inverse placement: the paper's Fig. 5 cases, 2L < P, and CT/NCT from the models."""

from __future__ import annotations

import pytest

from kfacflow import UserError
from kfacflow.kfac.placement import (
    EVERY_RANK,
    by_layer,
    gathers,
    layer,
    layer_order,
    lbp,
    local,
    round_robin,
    update_buckets,
)
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
    from kfacflow.kfac.placement import schedule

    # Fig. 5c placement: T1 (10) on r0, T3 (8) and T4 (9) on r1, T2 (7) everywhere.
    owners = [0, EVERY_RANK, 1, 1]
    order = schedule(DIMS, owners, 2, profile(0.4))
    # r1 inverts 9 (done at 0.729 s) before 8 (1.241 s); r0 finishes 10 at 1.0 s; the NCT comes last.
    assert order == [3, 0, 2, 1]
    assert schedule(DIMS, [EVERY_RANK] * 4, 2, None) == [0, 1, 2, 3]


def test_inverse_phase_queues_broadcasts_on_one_link() -> None:
    from kfacflow.kfac.placement import inverse_phase, schedule

    # Fig. 5c placement, broadcasts of 0.4 s on one link, in the schedule's order [T4, T1, T3, T2].
    owners = [0, EVERY_RANK, 1, 1]
    costs, comms = [1.0, 0.343, 0.512, 0.729], [0.4] * 4
    busy, arrivals = inverse_phase(costs, comms, owners, schedule(DIMS, owners, 2, profile(0.4)), 2)
    # T4 leaves r1 at 0.729 and arrives at 1.129; T1 is ready at 1.0 but waits for the link until
    # 1.129 (Algorithm 1 counts it as arriving at 1.4); T3 is ready at 1.241, sent at 1.529.
    assert arrivals == pytest.approx([1.129, 1.529, 1.929, 0.0])
    assert busy == pytest.approx([1.343, 1.584])  # each rank then inverts the NCT T2


def test_link_aware_placement_keeps_a_factor_local_when_its_broadcast_would_queue() -> None:
    from kfacflow.kfac.placement import link

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
