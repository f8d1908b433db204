"""dpfast.distributed.output_adjoint on 2 and 3 gloo ranks: the gathered outputs' adjoint (each rank gets its part of
every rank's output gradients, summed, by one all-to-all per dtype) equals what every rank's gradients all-reduced
and then cut to this rank's part give, for every kind of output: "cat" along any axis (this rank's rows, none, or
a rank whose outputs do not count), a stacked 0-dim output, "mean" and "sum" ones, gradients expanded from one
element, and dtypes in groups of one (float64, complex64) and of several (float32)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpfast.distributed.group import RankGroup
from dpfast.distributed.output_adjoint import GatheredOutputs
from dpfast.distributed.output_layout import sort_outputs

from ddp_harness import GroupRuns

# per rank: its rows of the "cat" tensors a (axis 1), b (axis 0) and z (0-dim, stacked); rank 1 has none. One rank:
# nothing to sum, and a dtype group of one output (b, m) is sent as it is
ROWS = {1: [(3, 2, 1)], 2: [(3, 2, 1), (0, 0, 0)], 3: [(3, 2, 1), (0, 0, 0), (2, 4, 1)]}
OUT_DIMS = {"a": 1, "b": 0, "m": "mean", "s": "sum", "z": 0}


def _local(rows: tuple, counts: bool) -> dict:
    """This rank's outputs; ``counts`` False: a rank whose outputs do not count, with rows all the same."""
    na, nb, _ = rows if counts else (1, 1, 1)
    return {
        "a": torch.zeros(4, na, 2),
        "b": torch.zeros(nb, 3, dtype=torch.complex64),
        "m": torch.zeros(2, dtype=torch.float64),
        "s": torch.zeros((), dtype=torch.float32),
        "z": torch.zeros((), dtype=torch.float32),
    }


def _adjoint_is_the_all_reduce_cut(counts: bool, expanded: bool = False) -> None:
    """``expanded``: every gradient one element broadcast (strides 0), as ``out.sum().backward()`` gives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = ROWS[world]
    got = sort_outputs(_local(rows[rank], counts or rank != 1), OUT_DIMS, 0, True)
    layout = got.layout
    sizes = [r[0] for r in rows]
    mean_w = [s / sum(sizes) for s in sizes]
    sum_w = [1.0 if s else 0.0 for s in sizes]
    gathered = GatheredOutputs(RankGroup(dist.group.WORLD, rank, world, torch.device("cpu")), layout, rows, mean_w,
                               sum_w, parts=[])  # fmt: skip
    total = [sum(r[k] for r in rows) for k in range(3)]
    full = {"a": (4, total[0], 2), "b": (total[1], 3), "m": (2,), "s": (), "z": (total[2],)}
    g = torch.Generator().manual_seed(10 + rank)  # every rank's gradients differ
    grads = []
    for t, name in zip(got.tensors, ("a", "b", "m", "s", "z")):
        grads.append(torch.randn(full[name], generator=g, dtype=torch.float64).to(t.dtype))
    grads[1] = grads[1] + 1j * torch.randn(full["b"], generator=g).to(grads[1].dtype)
    if expanded:
        grads = [x.reshape(-1)[0].expand(x.shape) if x.numel() else x for x in grads]

    mine = gathered.backward(grads)

    summed = [x.clone() for x in grads]
    for x in summed:
        dist.all_reduce(x)
    start = [sum(r[k] for r in rows[:rank]) for k in range(3)]
    n = rows[rank]
    counted = counts or rank != 1
    expected = {
        "a": summed[0].narrow(1, start[0], n[0]) if counted else torch.zeros(4, 1, 2),
        "b": summed[1].narrow(0, start[1], n[1]) if counted else torch.zeros(1, 3, dtype=torch.complex64),
        "m": summed[2] * mean_w[rank] if mean_w[rank] else torch.zeros(2, dtype=torch.float64),
        "s": summed[3] * sum_w[rank] if sum_w[rank] else torch.zeros(()),
        "z": summed[4][start[2]] if n[2] else torch.zeros(()),
    }
    for name, got_grad, t in zip(expected, mine, got.tensors):
        assert got_grad.shape == t.shape and got_grad.dtype == t.dtype, (name, got_grad.shape, t.shape)
        torch.testing.assert_close(got_grad, expected[name], msg=lambda m, name=name: f"{name}: {m}")


def _scenarios(world):
    return {
        "adjoint_is_the_all_reduce_cut": lambda: _adjoint_is_the_all_reduce_cut(True),
        "adjoint_of_a_rank_whose_outputs_do_not_count": lambda: _adjoint_is_the_all_reduce_cut(False),
        "adjoint_of_expanded_gradients": lambda: _adjoint_is_the_all_reduce_cut(True, expanded=True),
    }


RUNS = GroupRuns(_scenarios, worlds=(1, 2, 3))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
