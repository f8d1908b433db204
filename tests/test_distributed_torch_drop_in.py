"""dpfast's DistributedDataParallel where code written for torch's DDP reaches past ``forward`` (issue 47): it
pickles and deep-copies, takes torch's positional arguments, backs through ``create_graph=True`` and sparse
gradients, keeps torch's comm-hook bookkeeping, and runs ``join()`` for uneven inputs with the per-step checks on.

Each scenario trains torch's DDP and dpfast's side by side on the same rank (``inputs="per_rank"``, every other
setting at its default) and compares the parameters: bit for bit where both take the same path. torch's own tests
of the same things run in tests/test_torch_ddp_suite.py.
"""

from __future__ import annotations

import copy
import functools
import inspect
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dpfast

from ddp_harness import GroupRuns, expect_batch_error


def _net(sparse: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if sparse:
        return _Bag()
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4, sparse=True).double()
        self.out = nn.Linear(4, 2).double()

    def forward(self, idx):
        return self.out(self.emb(idx).sum(1))


def _batch(step: int, rank: int, sparse: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    if sparse:
        return torch.randint(0, 10, (3 + rank, 2), generator=g)
    return torch.randn(3 + rank, 4, generator=g, dtype=torch.float64)


def _train(ddp: nn.Module, steps: int, sparse: bool = False, create_graph: bool = False) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(steps):
        opt.zero_grad()
        ddp(_batch(step, rank, sparse)).pow(2).sum().backward(create_graph=create_graph)
        opt.step()


def _assert_same_parameters(a: nn.Module, b: nn.Module, exact: bool = True) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if exact:
            assert torch.equal(p, q), f"{name} differs from torch's DDP"
        else:
            torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")


def _pair(sparse: bool = False, **kwargs):
    net = _net(sparse)
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(net), **kwargs)
    mine = dpfast.DistributedDataParallel(net, inputs="per_rank", **kwargs)
    return theirs, mine


def _pickle_and_deepcopy(world):
    theirs, mine = _pair()
    buf = io.BytesIO()
    torch.save(mine, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    copied = copy.deepcopy(mine)
    for ddp in (theirs, mine, loaded, copied):
        _train(ddp, 3)
    for ddp in (mine, loaded, copied):
        _assert_same_parameters(ddp.module, theirs.module)
    # the copy checks its steps as the original does
    rank = dist.get_rank()
    x = _batch(9, rank)
    expect_batch_error(lambda: copied(x if rank == 0 else x.float()).sum().backward(), ["dtype"])


def _torch_positional(**values):
    """torch's DDP arguments up to the last of `values`, by position in this torch's order (it changes: init_sync)."""
    names = list(inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters.values())[2:]
    last = max(i for i, p in enumerate(names) if p.name in values)
    return tuple(values.get(p.name, p.default) for p in names[: last + 1])


def _positional_arguments(world):
    net = _net()
    args = _torch_positional(dim=0, broadcast_buffers=False, process_group=None, bucket_cap_mb=1)
    ddp = dpfast.DistributedDataParallel(net, *args, inputs="per_rank")
    syncs_buffers = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None))  # (torch < 2.10)
    assert ddp.dim == 0 and syncs_buffers is False and ddp.process_group is not None
    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(_net()), *args)
    _train(ddp, 2)
    _train(theirs, 2)
    _assert_same_parameters(ddp.module, theirs.module)
    with pytest.raises(TypeError, match="by position or by name"):
        dpfast.DistributedDataParallel(_net(), None, None, 0, True, broadcast_buffers=True)
    with pytest.raises(TypeError, match="positional arguments"):
        dpfast.DistributedDataParallel(_net(), None, None, 0, *([None] * 40))


class _Scale(nn.Module):
    """One parameter: with more, torch's own reducer refuses create_graph=True (an in-place copy into a bucket)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.linspace(0.5, 2.0, 4, dtype=torch.float64))

    def forward(self, x):
        return (x * self.p).pow(2)


def _create_graph(world):
    theirs = nn.parallel.DistributedDataParallel(_Scale())
    mine = dpfast.DistributedDataParallel(_Scale(), inputs="per_rank")
    rank = dist.get_rank()
    for ddp in (theirs, mine):
        for step in range(3):  # as torch's own test: gradients with a graph, then a second-order one
            ddp.zero_grad(set_to_none=True)
            ddp(_batch(step, rank)).sum().backward(create_graph=True)
            assert ddp.module.p.grad.requires_grad
            grad = ddp.module.p.grad
        (second,) = torch.autograd.grad(grad.sum(), ddp.module.p)
        ddp.second = second
    assert torch.equal(mine.module.p.grad, theirs.module.p.grad)
    assert torch.equal(mine.second, theirs.second)


def _allreduce_mean(state, bucket):
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def _sparse_gradients(world):
    for view in (False, True):
        theirs, mine = _pair(sparse=True, gradient_as_bucket_view=view)
        _train(theirs, 3, sparse=True)
        _train(mine, 3, sparse=True)
        # (the all-reduced sparse gradient reaches SGD as the comm hook returns it, its rows in another order)
        _assert_same_parameters(mine.module, theirs.module, exact=False)
    rank = dist.get_rank()
    x = _batch(9, rank, sparse=True)
    expect_batch_error(lambda: mine(x if rank == 0 else x.int()).sum().backward(), ["dtype"])


def _comm_hook_bookkeeping(world):
    theirs, mine = _pair()
    assert mine._get_ddp_logging_data().get("comm_hook") == theirs._get_ddp_logging_data().get("comm_hook")
    for ddp in (theirs, mine):  # on a fresh wrapper, as torch allows it
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        assert ddp._get_ddp_logging_data()["comm_hook"] == str(dist.BuiltinCommHookType.ALLREDUCE)
        with pytest.raises(RuntimeError, match="can only be called once"):
            ddp.register_comm_hook(None, _allreduce_mean)
    _train(theirs, 2)
    _train(mine, 2)
    _assert_same_parameters(mine.module, theirs.module, exact=False)
    theirs, mine = _pair()
    for ddp in (theirs, mine):
        ddp.register_comm_hook(None, _allreduce_mean)
        assert ddp._get_ddp_logging_data()["comm_hook"] == "_allreduce_mean"
    for ddp in (theirs, mine):
        with pytest.raises(RuntimeError) as raised:
            ddp.register_comm_hook(None, _allreduce_mean)
        assert "register_comm_hook or register_builtin_comm_hook can only be called once." in str(raised.value)


def _join(world, divide_by_initial_world_size):
    theirs, mine = _pair()
    rank = dist.get_rank()
    for ddp in (theirs, mine):  # rank r runs 2 + r steps: the others shadow its last ones
        with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size):
            _train(ddp, 2 + rank)
    # summing over the active ranks and dividing after rounds differently from torch's divide-then-sum
    _assert_same_parameters(mine.module, theirs.module, exact=divide_by_initial_world_size)


def _join_still_checks(world):
    _, mine = _pair()
    rank = dist.get_rank()

    def steps():
        with mine.join():
            _train(mine, 1)
            if world > 2 and rank == 0:
                return  # rank 0 runs out after one step: the others disagree on the next, rank 0 shadowing it
            x = _batch(5, rank)
            mine(x if rank == world - 1 else x.float()).sum().backward()

    expect_batch_error(steps, ["dtype"])


def _join_and_gathered_outputs(world):
    ddp = dpfast.DistributedDataParallel(_net(), inputs="per_rank", gather_outputs=True)
    with pytest.raises(ValueError, match="gather_outputs=False to use join"):
        ddp.join()
    with ddp.join(enable=False):
        ddp(_batch(0, dist.get_rank())).sum().backward()


def _scenarios(world):
    scenarios = {
        "pickle_and_deepcopy": _pickle_and_deepcopy,
        "positional_arguments": _positional_arguments,
        "create_graph": _create_graph,
        "sparse_gradients": _sparse_gradients,
        "comm_hook_bookkeeping": _comm_hook_bookkeeping,
        "join_divide_by_initial": functools.partial(_join, divide_by_initial_world_size=True),
        "join_divide_by_active": functools.partial(_join, divide_by_initial_world_size=False),
        "join_still_checks": _join_still_checks,
        "join_and_gathered_outputs": _join_and_gathered_outputs,
    }
    return {name: functools.partial(fn, world) for name, fn in scenarios.items()}


RUNS = GroupRuns(_scenarios, worlds=(2, 3))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
