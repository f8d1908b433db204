"""dpfast.distributed.module runs torch's DDP forward steps (pre-forward, the module, post-forward),
without the profiler label torch enters on every call (``record_function("DistributedDataParallel.forward")``,
two calls through ``torch.ops`` a forward) unless a profiler is recording, where the label is there as in torch.
When torch's forward is not the one these steps copy, torch's own forward runs.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import profiler

import dpfast
from dpfast.distributed import module as ddp_module
from dpfast.distributed.inputs import shard_range

from ddp_harness import GroupRuns

LABEL = "DistributedDataParallel.forward"


@contextlib.contextmanager
def _labels():
    """The names of every ``record_function`` entered in the block (torch's forward looks it up at each call)."""
    entered: list[str] = []
    original = profiler.record_function

    class Counted(original):  # type: ignore[misc, valid-type]
        def __enter__(self):
            entered.append(self.name)
            return super().__enter__()

    profiler.record_function = Counted
    try:
        yield entered
    finally:
        profiler.record_function = original


def _wrappers():
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(1))
    mine = shard_range(len(x), rank, world)
    xs = x[mine.start : mine.stop]
    ours = {
        "global": (dpfast.DistributedDataParallel(mlp()), x),
        "per_rank": (dpfast.DistributedDataParallel(mlp(), inputs="per_rank"), xs),
        "gather": (dpfast.DistributedDataParallel(mlp(), gather_outputs=True), x),
        "unchecked": (dpfast.DistributedDataParallel(mlp(), check_batch=False), x),
    }
    return nn.parallel.DistributedDataParallel(mlp()), xs, ours


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    F.mse_loss(out, torch.ones_like(out)).backward()
    return out


def _same_as_torch(torch_ddp, xs, ours, steps=3):
    """Every wrapper's rows of the output and its gradients equal torch's DDP on this rank's rows, bit for bit."""
    for _ in range(steps):
        want = _step(torch_ddp, xs)
        for name, (model, x) in ours.items():
            out = _step(model, x)
            if name == "gather":  # the full batch: this rank's rows of it (the loss is another: no grads compared)
                share = model.share
                assert torch.equal(out[share.start : share.stop], want), name
                continue
            assert torch.equal(out, want), name
            for p, q in zip(torch_ddp.parameters(), model.parameters()):
                assert torch.equal(p.grad, q.grad), name


def _no_label_without_a_profiler():
    torch_ddp, xs, ours = _wrappers()
    _same_as_torch(torch_ddp, xs, ours, steps=2)  # first calls (planned in full), then calls like the kept one
    with _labels() as entered:
        _step(torch_ddp, xs)
    assert entered == [LABEL], entered  # the counter sees torch's label
    for name, (model, x) in ours.items():
        with _labels() as entered:
            for _ in range(3):
                _step(model, x)
        assert entered == [], (name, entered)
    _same_as_torch(torch_ddp, xs, ours)


def _the_label_under_a_profiler():
    torch_ddp, xs, ours = _wrappers()
    _same_as_torch(torch_ddp, xs, ours, steps=2)
    for name, (model, x) in ours.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                _step(model, x)
        labels = [e.name for e in prof.events() if e.name == LABEL]
        assert len(labels) == 2, (name, labels)


@contextlib.contextmanager
def _set(obj, name, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _the_label_whichever_check_sees_a_profiler():
    """Each check alone keeps the label (under a real profiler both profiler checks are true): a profiler recording
    this thread, the flag any ``torch.autograd.profiler.profile`` sets, and torch.compile (torch's forward then).
    (The legacy profiler, which sets only the first, failed to parse its records of a DDP forward on gloo here.)"""
    torch_ddp, xs, ours = _wrappers()
    _same_as_torch(torch_ddp, xs, ours, steps=2)
    for name, (model, x) in ours.items():
        for switch in (
            _set(ddp_module, "_profiler_on", lambda: True),
            _set(profiler, "_is_profiler_enabled", True),
            _set(ddp_module, "_compiling", lambda: True),
        ):
            with switch, _labels() as entered:
                _step(model, x)
            assert entered == [LABEL], (name, entered)
    _same_as_torch(torch_ddp, xs, ours)


def _torch_forward_when_its_steps_differ():
    """A torch whose DDP forward is not the one copied: torch's forward runs (its label with it), results alike."""
    saved = ddp_module._TORCH_FORWARD_COPIED
    ddp_module._TORCH_FORWARD_COPIED = False
    try:
        torch_ddp, xs, ours = _wrappers()
        for name, (model, x) in ours.items():
            with _labels() as entered:
                _step(model, x)
            assert entered.count(LABEL) == 1, (name, entered)
        _same_as_torch(torch_ddp, xs, ours)
    finally:
        ddp_module._TORCH_FORWARD_COPIED = saved


# torch's DistributedDataParallel.forward as _ddp_forward copies it (torch 2.4 to 2.14 at least)
_COPIED = """
def forward(self, *inputs, **kwargs):
    with torch.autograd.profiler.record_function("DistributedDataParallel.forward"):
        inputs, kwargs = self._pre_forward(*inputs, **kwargs)
        output = (
            self.module.forward(*inputs, **kwargs)
            if self._delay_all_reduce_all_params
            else self._run_ddp_forward(*inputs, **kwargs)
        )
        return self._post_forward(output)
"""


def test_the_copied_steps_are_torchs_forward():
    """A tripwire for a torch upgrade: torch's DDP forward is, statement for statement, the one the copy follows
    (the import-time check reads only the names it uses). Where this fails the wrapper still runs correctly,
    through torch's own forward (when the names differ) or through a copy to compare anew with torch's."""
    source = textwrap.dedent(inspect.getsource(nn.parallel.DistributedDataParallel.forward))
    assert ast.dump(ast.parse(source)) == ast.dump(ast.parse(_COPIED))
    assert ddp_module._TORCH_FORWARD_COPIED


def _scenarios(world):
    return {
        "no_label_without_a_profiler": _no_label_without_a_profiler,
        "the_label_under_a_profiler": _the_label_under_a_profiler,
        "the_label_whichever_check_sees_a_profiler": _the_label_whichever_check_sees_a_profiler,
        "torch_forward_when_its_steps_differ": _torch_forward_when_its_steps_differ,
    }


RUNS = GroupRuns(_scenarios, worlds=(2,))
test_group_ran_every_scenario = RUNS.group_test()
test_scenario = RUNS.scenario_test()
