"""``dpfast.distributed.fully_shard`` (FSDP2 with dpfast's specs) on 2 and 3 gloo ranks, float64: outputs, states,
gradients and parameters after several optimizer steps equal single-process full-batch training, alone and mixed
with torch's per-block ``fully_shard``, with ``reshard_after_forward`` both ways; ranks that disagree raise on every
rank, on any step, and the module still trains afterwards."""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

import dpfast
from dpfast.distributed import DistributedBatchError, shard_batch
from dpfast.distributed.agreement import StepRecord, agree_now
from dpfast.distributed.disagreement import CANNOT_PLAN, OK
from dpfast.distributed.group import RankGroup

from ddp_harness import RRN, GroupRuns, assert_tree_close, expect_batch_error, losses_loss, rrn_inputs, rrn_loss, xy
from dp_testing import DT, Losses, NoEmpty

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("FSDP2 is torch.distributed.fsdp.fully_shard from torch 2.6", allow_module_level=True)


class Blocks(nn.Module):
    """Two blocks the user may shard on their own, as FSDP2 users do, then the root."""

    def __init__(self):
        super().__init__()
        self.block0 = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.block1 = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x, y):
        pred = self.head(self.block1(self.block0(x)))
        return ((pred - y) ** 2).mean(), pred


def _mesh(shape=None):
    from torch.distributed.device_mesh import init_device_mesh

    if shape is None:
        return init_device_mesh("cpu", (dist.get_world_size(),))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))  # HSDP


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _assert_grads_and_params(net, ref, what):
    for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        assert p.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(_full(p.grad), q.grad, msg=lambda m, n=name: f"{what}, grad of {n}: {m}")
        torch.testing.assert_close(_full(p.detach()), q.detach(), msg=lambda m, n=name: f"{what}, {n}: {m}")


def _train_vs_full_batch(
    factory, batch, loss_fn, kwargs, steps=3, blocks=False, per_rank_dims=None, reasoning=1, mesh_shape=None
):
    """Several SGD steps of the sharded module and of the plain one on the whole batch, compared at every step:
    outputs (gathered), parameter gradients and parameters. ``per_rank_dims``: each rank passes its own rows
    (cut by ``shard_batch`` with those in_dims); ``reasoning``: calls per step, feeding the gathered outputs back
    (the RRN, with the global batch); ``mesh_shape``: a 2-D (HSDP) mesh, replicated x sharded."""
    torch.manual_seed(0)
    ref = factory().to(DT)
    torch.manual_seed(0)  # FSDP2 broadcasts nothing: every rank builds the same module
    net = factory().to(DT)
    mesh = _mesh(mesh_shape)
    if blocks:
        for block in (net.block0, net.block1):
            fsdp.fully_shard(block, mesh=mesh, reshard_after_forward=kwargs.get("reshard_after_forward", True))
    per_rank = per_rank_dims is not None
    keys = list(net.state_dict())
    sharded = dpfast.distributed.fully_shard(
        net, mesh=mesh, gather_outputs=True, inputs="per_rank" if per_rank else "global", **kwargs
    )
    assert sharded is net and isinstance(net, fsdp.FSDPModule)
    assert list(net.state_dict()) == keys
    opt, opt_ref = torch.optim.SGD(net.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(steps):
        args = batch(step)
        mine = shard_batch(args, in_dims=per_rank_dims) if per_rank else args
        outs, wants = [], []
        for _ in range(reasoning):
            outs.append(net(*mine))
            wants.append(ref(*args))
            args, mine = (args[0],) + tuple(wants[-1][1:]), (mine[0],) + tuple(outs[-1][1:])  # (global inputs)
        assert_tree_close(outs, wants, f"step {step} outputs")
        sum(loss_fn(o) for o in outs).backward()
        sum(loss_fn(w) for w in wants).backward()
        _assert_grads_and_params(net, ref, f"step {step}")
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(_full(p.detach()), q.detach(), msg=lambda m, n=name: f"after training, {n}: {m}")


def _xy_batches(b):
    return lambda step: xy(b + step)


def _blocks_loss(outputs):
    loss, pred = outputs
    return loss + pred.pow(2).mean()


def _rrn_batches(b):
    return lambda step: rrn_inputs(b)


def _local_outputs_mean_loss(world):
    """Without gather_outputs each rank gets its own rows' outputs; with equal shares and a per-sample mean loss
    FSDP's averaged gradient is the full-batch one."""
    torch.manual_seed(0)
    ref = Losses().to(DT)
    torch.manual_seed(0)
    net = dpfast.distributed.fully_shard(Losses().to(DT), mesh=_mesh())
    x, y = xy(2 * world)
    mse, _, pred = net(x, y)
    assert pred.shape == (2, 2)
    mse.backward()
    ref(x, y)[0].backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.grad), q.grad)


def _disagreements(world, gather):
    """A rank given another dtype, another B, or an unplannable batch: every rank raises, on the first step and
    after good ones, before FSDP's forward hook, so the module then trains on."""
    torch.manual_seed(0)
    net = dpfast.distributed.fully_shard(
        Losses().to(DT), mesh=_mesh(), gather_outputs=gather, out_dims=("mean", "sum", 0)
    )
    rank = dist.get_rank()
    x, y = xy(5)
    expect_batch_error(lambda: net(x if rank else x.float(), y), ["torch.float32"])
    for _ in range(2):
        net(x, y)[0].backward()
    expect_batch_error(lambda: net(x if rank else x.float(), y), ["torch.float32"])
    expect_batch_error(lambda: net(x[: 4 + (rank == 1)], y[: 4 + (rank == 1)]), ["B"])
    expect_batch_error(lambda: net(x, y[:3] if rank == 0 else y), ["split"])
    net(x, y)[0].backward()  # still trains: nothing ran past FSDP's hook on the failed calls


def _new_weights_after_a_failed_check(world, gather):
    """A failed check leaves no stale all-gather behind: FSDP's unshard of the root, started alongside the check,
    is undone, so the forward after an optimizer step sees the new weights."""
    torch.manual_seed(0)
    ref = nn.Linear(3, 2).to(DT)
    torch.manual_seed(0)
    net = dpfast.distributed.fully_shard(nn.Linear(3, 2).to(DT), mesh=_mesh(), gather_outputs=gather)
    opt, opt_ref = torch.optim.SGD(net.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.arange(18, dtype=DT).reshape(6, 3) / 10
    rank = dist.get_rank()
    for step in range(3):
        out, want = net(x), ref(x)
        if not gather:
            out = torch.cat(dist_nn.all_gather(out))
        assert_tree_close(out, want, f"step {step} outputs")
        out.sum().backward()
        want.sum().backward()
        expect_batch_error(lambda: net(x if rank == 0 else x[:5]), ["B"])  # between backward and the update
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p.detach()), q.detach())


class NeedsTwo(Losses):
    """Refuses fewer than two samples, as BatchNorm in training mode refuses one: neither an empty share nor the
    stand-in sample runs."""

    def forward(self, x, y):
        if x.shape[0] < 2:
            raise RuntimeError("NeedsTwo needs at least two samples")
        return super().forward(x, y)


def _rank_without_rows_that_cannot_run(world, inputs, gather):
    """A rank without rows whose module refuses both its empty share and the stand-in sample: every rank raises
    promptly, saying so, with local outputs too (the others used to wait in FSDP's backward), and the module
    trains on."""
    torch.manual_seed(0)
    kw = dict(chunk_sizes=[1] * (world - 1) + [0]) if inputs == "global" else {}
    net = dpfast.distributed.fully_shard(
        NeedsTwo().to(DT), mesh=_mesh(), inputs=inputs, gather_outputs=gather, out_dims=("mean", "sum", 0), **kw
    )
    x, y = xy(2 * world)
    last = dist.get_rank() == world - 1
    rows = (x[:0], y[:0]) if last else (x[:2], y[:2])
    call = (lambda: net(x, y)) if inputs == "global" else (lambda: net(*rows))
    msg = expect_batch_error(call, ["no rows of this batch", "NeedsTwo needs at least two samples"])
    assert "raised in" not in msg, msg
    if inputs == "per_rank":
        net(x[:2], y[:2])[0].backward()  # every rank with rows: it trains on


def _suggested_fix_names_fully_shard(world):
    """The seed RRN without in_dims: every rank raises with this rank's table and a fix written as a call of
    fully_shard, not DataParallel; and the fix (with the outputs' state on axis 1) is the fix."""
    x, hid, h = rrn_inputs(5)
    torch.manual_seed(0)
    net = dpfast.distributed.fully_shard(RRN().to(DT), mesh=_mesh(), gather_outputs=True)
    msg = expect_batch_error(lambda: net(x, hid, h), ["could not split"])
    fix = "suggested fix: dpfast.distributed.fully_shard(..., in_dims={'h': 1})"
    assert fix in msg, msg
    torch.manual_seed(0)
    fixed = dpfast.distributed.fully_shard(
        RRN().to(DT), mesh=_mesh(), gather_outputs=True, in_dims={"h": 1}, out_dims=(0, 0, 1)
    )
    with torch.no_grad():
        assert fixed(x, hid, h)[2][0].shape == h[0].shape


def _checks_on_the_host(world):
    """The check's result is read before each forward, so its buffers are on the host: a CUDA mesh's group that
    takes CPU tensors serves with CPU buffers, and one without gloo gets a gloo group of the same ranks (made here
    with the backend reported as NCCL's), over which a disagreement raises on every rank. A group of one checks
    without a collective, and still raises for a call that cannot be planned."""
    rank = dist.get_rank()
    cuda_side = RankGroup(dist.group.WORLD, rank, world, torch.device("cuda", 0))
    served = cuda_side.on_host()
    assert served.process_group is dist.group.WORLD and served.comm_device == torch.device("cpu")
    with mock.patch.object(dist, "get_backend", return_value="nccl"):
        made = cuda_side.on_host()
    assert made.process_group is not dist.group.WORLD and made.comm_device == torch.device("cpu")
    assert dist.get_backend(made.process_group) == "gloo"
    agree_now(made.process_group, made.comm_device, [StepRecord(OK, None, {"B": "5"})])
    b_differs = [StepRecord(OK, None, {"B": str(5 + rank)})]
    expect_batch_error(lambda: agree_now(made.process_group, made.comm_device, b_differs), ["B"])
    alone = [dist.new_group([r]) for r in range(world)][rank]
    with mock.patch.object(dist, "all_gather", side_effect=AssertionError("a collective on a group of one")):
        agree_now(alone, torch.device("cpu"), [StepRecord(OK, None, {"B": "5"})])
    unplannable = StepRecord(CANNOT_PLAN, ValueError("in_dims names no argument"), {})
    with pytest.raises(DistributedBatchError, match="in_dims names no argument"):
        agree_now(alone, torch.device("cpu"), [unplannable])


def _settings_disagree(world):
    net = Losses().to(DT)
    in_dims = {"x": 0} if dist.get_rank() == 0 else None
    msg = expect_batch_error(lambda: dpfast.distributed.fully_shard(net, mesh=_mesh(), in_dims=in_dims), ["in_dims"])
    assert msg.startswith("dpfast.distributed.fully_shard:"), msg


def _outputs_need_grad_on_some_ranks_only(world):
    """The output exchange's own errors name this wrapper, not DistributedDataParallel."""
    net = dpfast.distributed.fully_shard(Losses().to(DT), mesh=_mesh(), gather_outputs=True, out_dims=("mean", 0, 0))
    x, y = xy(5)

    def call():
        with torch.set_grad_enabled(dist.get_rank() != 0):
            net(x, y)

    msg = expect_batch_error(call, ["need grad"])
    assert msg.startswith("dpfast.distributed.fully_shard(gather_outputs=True):"), msg
    net(x, y)[0].backward()  # and it trains on


def _refusals(world):
    net = dpfast.distributed.fully_shard(Losses().to(DT), mesh=_mesh())
    with pytest.raises(ValueError, match="already applied"):
        dpfast.distributed.fully_shard(net, mesh=_mesh())
    with pytest.raises(ValueError, match="a DeviceMesh"):
        dpfast.distributed.fully_shard(Losses().to(DT), mesh="cpu")
    with pytest.raises(ValueError, match="inputs must be"):
        dpfast.distributed.fully_shard(Losses().to(DT), inputs="rows")
    torch_sharded = fsdp.fully_shard(Losses().to(DT), mesh=_mesh())
    with pytest.raises(ValueError, match="torch's fully_shard was already applied to this module: apply dpfast"):
        dpfast.distributed.fully_shard(torch_sharded, mesh=_mesh())
    typo = Losses().to(DT)
    with pytest.raises(TypeError, match="unexpected keyword argument 'reshard_after_forwards'"):
        dpfast.distributed.fully_shard(typo, mesh=_mesh(), reshard_after_forwards=False)
    fixed = dpfast.distributed.fully_shard(typo, mesh=_mesh(), reshard_after_forward=False)  # nothing was left
    fixed(*xy(5))


def _default_mesh(world):
    torch.manual_seed(0)
    net = dpfast.distributed.fully_shard(Losses().to(DT), gather_outputs=True, out_dims=("mean", "sum", 0))
    _, _, pred = net(*xy(world + 2))
    assert pred.shape == (world + 2, 2)


def _example_check(world):
    """examples/fsdp_rrn.py's float64 check on the seed's RRN, three calls feeding the state back: the global batch,
    and one a rank has no rows of (the RRN refuses an empty batch: a ghost runs)."""
    from dpfast.__main__ import load_example

    example = load_example("fsdp_rrn")
    for b in (6, world - 1):
        assert example.check(example.Config(batch=b), torch.device("cpu"), b) < 1e-9


def _compiled(world, in_place):
    """torch.compile of the sharded root (or module.compile()): the split, the check and the gather run as they
    are (graph breaks), the module's forward is compiled, and training equals single-process full-batch."""
    kw = dict(out_dims=("mean", "sum", 0))
    torch.manual_seed(0)
    ref = Losses().to(DT)
    torch.manual_seed(0)
    net = dpfast.distributed.fully_shard(Losses().to(DT), mesh=_mesh(), gather_outputs=True, **kw)
    if in_place:
        net.compile(backend="eager")
        model = net
    else:
        model = torch.compile(net, backend="eager")
    for step in range(2):
        x, y = xy(7 + step)
        out, want = model(x, y), ref(x, y)
        assert_tree_close(out, want, f"step {step} outputs")
        losses_loss(out).backward()
        losses_loss(want).backward()
        _assert_grads_and_params(net, ref, f"step {step}")
    expect_batch_error(lambda: model(x if dist.get_rank() else x.float(), y), ["torch.float32"])


def _scenarios(world):
    out = {}
    losses_kw = dict(out_dims=("mean", "sum", 0))
    for b in (world - 1, 7):  # a rank without rows; uneven shares
        out[f"losses_B{b}"] = functools.partial(_train_vs_full_batch, Losses, _xy_batches(b), losses_loss, losses_kw)
    out["ghost_when_module_refuses_empty"] = functools.partial(
        _train_vs_full_batch, NoEmpty, _xy_batches(world - 1), losses_loss, losses_kw, steps=1
    )
    for reshard in (True, False):
        kw = dict(out_dims=("mean", 0), reshard_after_forward=reshard)
        out[f"per_block_reshard_{reshard}"] = functools.partial(
            _train_vs_full_batch, Blocks, _xy_batches(7), _blocks_loss, kw, blocks=True
        )
    for shape in ((world, 1), (1, world)):
        out[f"hsdp_mesh_{shape[0]}x{shape[1]}"] = functools.partial(
            _train_vs_full_batch, Losses, _xy_batches(7), losses_loss, losses_kw, mesh_shape=shape
        )
    out["per_rank_inputs"] = functools.partial(
        _train_vs_full_batch, Losses, _xy_batches(7), losses_loss, losses_kw, per_rank_dims=0
    )
    out["seed_rrn_state_fed_back"] = functools.partial(
        _train_vs_full_batch,
        RRN,
        _rrn_batches(5),
        rrn_loss,
        dict(in_dims={"h": 1}, out_dims=(0, 0, 1)),
        reasoning=2,
    )
    out["example_check"] = functools.partial(_example_check, world)
    out["local_outputs_mean_loss"] = functools.partial(_local_outputs_mean_loss, world)
    out["disagreements_gathered"] = functools.partial(_disagreements, world, True)
    out["disagreements_local"] = functools.partial(_disagreements, world, False)
    out["settings_disagree"] = functools.partial(_settings_disagree, world)
    out["checks_on_the_host"] = functools.partial(_checks_on_the_host, world)
    out["suggested_fix_names_fully_shard"] = functools.partial(_suggested_fix_names_fully_shard, world)
    for inputs in ("global", "per_rank"):
        for gather in (True, False):
            out[f"rank_without_rows_cannot_run_{inputs}_gather_{gather}"] = functools.partial(
                _rank_without_rows_that_cannot_run, world, inputs, gather
            )
    for gather in (True, False):
        out[f"new_weights_after_a_failed_check_gather_{gather}"] = functools.partial(
            _new_weights_after_a_failed_check, world, gather
        )
    out["refusals"] = functools.partial(_refusals, world)
    out["outputs_need_grad_on_some_ranks_only"] = functools.partial(_outputs_need_grad_on_some_ranks_only, world)
    out["default_mesh"] = functools.partial(_default_mesh, world)
    for in_place in (False, True):
        out[f"compiled_in_place_{in_place}"] = functools.partial(_compiled, world, in_place)
    return out


RUNS = GroupRuns(_scenarios, worlds=(2, 3))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()


def test_without_a_process_group_says_what_to_call():
    with pytest.raises(RuntimeError, match="init_process_group"):
        dpfast.distributed.fully_shard(Losses())
