"""``torch.compile`` and ``dpfast.DataParallel``: a compiled wrapper trains exactly as the wrapper does uncompiled
(and as the plain module does where the split cannot change the result), over many steps, with autograd, default
and ``dynamic=True``; dynamo breaks the graph at the wrapper's call only; and a compiled module *inside* the wrapper
is refused the same way by the constructor, ``plan()`` and the call."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import dpfast

pytestmark = pytest.mark.skipif(
    torch.__version__ < "2.14", reason="torch 2.4's dynamo fails tracing the wrapper (docs/installing.md)"
)


def _mlp(norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 8)] + ([nn.BatchNorm1d(8)] if norm else []) + [nn.ReLU(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def _train(model: nn.Module, steps: int, sizes: list[int]) -> list[tuple]:
    """Outputs, gradients and buffers of every step (batch sizes cycle through ``sizes``), SGD between steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for step in range(steps):
        x = torch.randn(sizes[step % len(sizes)], 4, generator=gen)
        opt.zero_grad()
        out = model(x)
        (out * out).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        seen.append((out.detach(), grads, [b.clone() for b in model.buffers()]))
    return seen


def _assert_same(got: list[tuple], want: list[tuple], exact: bool = True) -> None:
    """Every step's outputs, gradients and buffers equal: bit for bit, or (against the module on the whole batch,
    whose matrix products round otherwise than on chunks) to float32's rounding."""
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    for (o1, g1, b1), (o2, g2, b2) in zip(got, want, strict=True):
        for a, b in zip([o1, *g1, *b1], [o2, *g2, *b2], strict=True):
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_compiled_wrapper_trains_as_the_module(dynamic):
    """Every second call with autograd crashed in the lease (a graph token where a weak reference belongs)."""
    torch._dynamo.reset()
    plain = _mlp()
    eager = dpfast.DataParallel(copy.deepcopy(plain), ["cpu"] * 2)
    compiled = torch.compile(dpfast.DataParallel(copy.deepcopy(plain), ["cpu"] * 2), backend="eager", dynamic=dynamic)
    got = _train(compiled, 8, [6, 6, 5, 7])
    _assert_same(got, _train(eager, 8, [6, 6, 5, 7]))
    _assert_same(got, _train(plain, 8, [6, 6, 5, 7]), exact=False)


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_compiled_wrapper_trains_as_the_uncompiled_one_with_batchnorm(dynamic):
    """Each replica's BatchNorm sees its chunk (so not the module's statistics): compiled or not, the same."""
    torch._dynamo.reset()
    eager = dpfast.DataParallel(_mlp(norm=True), ["cpu"] * 3)
    compiled = torch.compile(dpfast.DataParallel(_mlp(norm=True), ["cpu"] * 3), backend="eager", dynamic=dynamic)
    _assert_same(_train(compiled, 6, [9, 7]), _train(eager, 6, [9, 7]))


class _Outer(nn.Module):
    """A model whose middle is data-parallel: dynamo compiles what comes before and after the wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.dp = dpfast.DataParallel(_mlp(), ["cpu"] * 2)

    def forward(self, x):
        return self.dp(self.pre(x).relu()) * 2


def test_the_graph_breaks_at_the_wrapper_only():
    torch._dynamo.reset()
    model = _Outer()
    explained = torch._dynamo.explain(model)(torch.randn(6, 4))
    assert explained.graph_break_count == 1
    assert explained.graph_count == 2  # before the wrapper's call, and after it
    assert "disable" in str(explained.break_reasons[0].reason)
    plain = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    _assert_same(_train(compiled, 4, [6, 5]), _train(plain, 4, [6, 5]))  # the same model uncompiled


def test_fullgraph_is_refused_by_dynamo_at_the_wrapper():
    """fullgraph=True asks for no break, and the wrapper's call is one (its replicas run on worker threads)."""
    torch._dynamo.reset()
    compiled = torch.compile(_Outer(), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="disable"):
        compiled(torch.randn(6, 4))


@pytest.mark.parametrize("how", ["torch.compile", "module.compile()"])
def test_a_compiled_module_inside_is_refused_by_the_constructor_plan_and_call_alike(how):
    model = _mlp()
    if how == "torch.compile":
        model = torch.compile(model, backend="eager")
    else:
        model.compile(backend="eager")
    with pytest.raises(TypeError, match=r"torch.compile\(dpfast.DataParallel\(model"):
        dpfast.DataParallel(model, ["cpu"] * 2)
    dp = dpfast.DataParallel(model, ["cpu"])  # one device: the module is called directly, as torch does
    torch.testing.assert_close(dp(torch.ones(2, 4)), model(torch.ones(2, 4)))


def test_a_module_compiled_after_the_wrapper_was_built_is_refused_by_plan_and_call_alike():
    model = _mlp()
    dp = dpfast.DataParallel(model, ["cpu"] * 2)
    model.compile(backend="eager")
    for what in (dp.plan, dp):
        with pytest.raises(TypeError, match=r"compiled in place.*torch.compile\(dpfast.DataParallel\(model"):
            what(torch.ones(2, 4))


def _scripted(kind: str) -> nn.Module:
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notice
        if kind == "script":
            return torch.jit.script(model)
        if kind == "trace":
            return torch.jit.trace(model, torch.randn(2, 4))
        inner = _mlp()
        inner[0] = torch.jit.script(inner[0])  # an eager model holding a scripted submodule
        return inner


@pytest.mark.parametrize("kind", ["script", "trace", "submodule"])
def test_a_torchscript_module_runs_on_one_device_as_torch_runs_it(kind):
    """Was a bare ``KeyError: 0`` from torch.jit, on one device too, where torch's DataParallel calls the module."""
    model = _scripted(kind)
    dp = dpfast.DataParallel(model, ["cpu"])
    x = torch.randn(6, 4)
    torch.testing.assert_close(dp(x), model(x), rtol=0, atol=0)
    assert dp.plan(x).mode == "direct"


@pytest.mark.parametrize("kind", ["script", "trace", "submodule"])
def test_a_torchscript_module_over_several_devices_is_refused_with_the_fix(kind):
    model = _scripted(kind)
    refusal = r"TorchScript.*cannot be copied into replicas.*dpfast.DataParallel\(model, \.\.\.\) before"
    with pytest.raises(TypeError, match=refusal):
        dpfast.DataParallel(model, ["cpu"] * 2)
    dp = dpfast.DataParallel(model, ["cpu"])
    dp.device_ids = ["cpu"] * 2
    for what in (dp.plan, dp):
        with pytest.raises(TypeError, match=refusal):
            what(torch.randn(6, 4))


def test_the_fix_for_a_torchscript_module_works():
    """What the refusal suggests: wrap the eager module (the one that was scripted) instead."""
    eager = _mlp()
    x = torch.randn(6, 4)
    dp = dpfast.DataParallel(eager, ["cpu"] * 2)
    torch.testing.assert_close(dp(x), eager(x))
