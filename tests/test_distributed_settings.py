"""The wrapper's own settings must agree across the ranks (issue 27, item 2): a difference is a clear error on every
rank, raised promptly by the constructor, that says per rank what differs; and the settings cannot change later.

Before, a rank built with gather_outputs=True (or another check_batch, chunk_sizes, cost, in_dims...) than the
others made them wait in different collectives: a 20 s timeout or a SIGABRT.
"""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist
from torch import nn

import dpfast

from ddp_harness import GroupRuns, expect_batch_error, xy
from dp_testing import DT, Losses


class ByLength(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, lengths):
        return self.lin(x) * lengths.unsqueeze(1)


def _one_rank_differs(name, mine, others):
    """Rank 1 builds the wrapper with ``name=mine``, the others with ``name=others``: every rank raises at once."""
    value = mine if dist.get_rank() == 1 else others
    module = ByLength() if name == "cost" else Losses()
    kwargs = {name: value}
    msg = expect_batch_error(
        lambda: dpfast.DistributedDataParallel(module.to(DT), **kwargs), contains=(f"different settings ({name})",)
    )
    assert f"{name}={mine!r}" in msg and f"{name}={others!r}" in msg, msg
    _still_usable()


def _still_usable():
    ddp = dpfast.DistributedDataParallel(Losses().to(DT), out_dims=("mean", "sum", 0), gather_outputs=True)
    mse, sse, pred = ddp(*xy(5))
    (mse + sse).backward()
    assert pred.shape == (5, 2)


def _invalid_on_one_rank():
    """A setting that is invalid on rank 1 only: rank 1 raised in its constructor while the others waited in torch's
    DDP broadcast until the timeout. Now every rank raises, promptly, naming rank 1's error."""
    in_dims = {"typo": 0} if dist.get_rank() == 1 else None
    msg = expect_batch_error(
        lambda: dpfast.DistributedDataParallel(Losses().to(DT), in_dims=in_dims), contains=("rank 1 are invalid",)
    )
    assert "typo" in msg, msg
    _still_usable()


def _invalid_everywhere():
    """The same mistake on every rank is that mistake, as without torch.distributed."""
    with pytest.raises(TypeError, match="typo"):
        dpfast.DistributedDataParallel(Losses().to(DT), in_dims={"typo": 0})
    _still_usable()


def _settings_are_fixed():
    ddp = dpfast.DistributedDataParallel(Losses().to(DT), out_dims=("mean", "sum", 0))
    for name, value in [("gather_outputs", True), ("in_dims", {"x": 0}), ("chunk_sizes", [1, 2]), ("dim", 1)]:
        with pytest.raises(AttributeError, match=f"{name} is fixed once built"):
            setattr(ddp, name, value)
    assert ddp.gather_outputs is False and ddp.in_dims is None and ddp.dim == 0
    ddp.find_unused_parameters = False  # torch's own attributes are untouched
    mse, _, _ = ddp(*xy(4))
    mse.backward()


def _dtype_lines_differ():
    """A dtype mismatch printed the same line for every rank (only shapes were shown): now each rank's dtype."""
    x, y = xy(4)
    if dist.get_rank() == 1:
        y = y.float()
    ddp = dpfast.DistributedDataParallel(Losses().to(DT), out_dims=("mean", "sum", 0), gather_outputs=True)
    msg = expect_batch_error(lambda: ddp(x, y), contains=("same B = 4 but different `y`",))
    assert "y: (4, 2) torch.float64" in msg and "y: (4, 2) torch.float32" in msg, msg


def _in_dims_is_named():
    """An in_dims mismatch was worded "different global batches": it is a setting, and is named as one."""
    in_dims = {"y": 0} if dist.get_rank() == 0 else {"y": None}
    msg = expect_batch_error(lambda: dpfast.DistributedDataParallel(Losses().to(DT), in_dims=in_dims))
    assert "different settings (in_dims)" in msg and "global batches" not in msg, msg


def _scenarios(world):
    out = {
        "gather_outputs": functools.partial(_one_rank_differs, "gather_outputs", True, False),
        "check_batch": functools.partial(_one_rank_differs, "check_batch", False, True),
        "check_batch_values": functools.partial(_one_rank_differs, "check_batch", "values", True),
        "out_dims": functools.partial(_one_rank_differs, "out_dims", ("mean", "sum", 0), None),
        "chunk_sizes": functools.partial(_one_rank_differs, "chunk_sizes", [1] * (world - 1) + [2], None),
        "cost": functools.partial(_one_rank_differs, "cost", "lengths", None),
        "dim": functools.partial(_one_rank_differs, "dim", 1, 0),
        "inputs": functools.partial(_one_rank_differs, "inputs", "per_rank", "global"),
    }
    out["in_dims"] = _in_dims_is_named
    out["invalid_on_one_rank"] = _invalid_on_one_rank
    out["invalid_everywhere"] = _invalid_everywhere
    out["settings_are_fixed"] = _settings_are_fixed
    out["dtype_lines_differ"] = _dtype_lines_differ
    return out


RUNS = GroupRuns(_scenarios, worlds=(2,))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
