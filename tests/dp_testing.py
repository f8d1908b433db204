"""Shared by the DataParallel test modules: comparing a DataParallel run with the plain module, and small models.

Everything is float64 so comparisons are tight; the vehicle is the CPU rehearsal ``device_ids=["cpu"] * n``.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

import dpfast

DT = torch.float64


def walk(obj: Any, fn):
    """Map ``fn`` over the tensor/PackedSequence leaves of tuples, lists, dicts, namedtuples and dataclasses."""
    if isinstance(obj, (torch.Tensor, PackedSequence)):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return type(obj)(*(walk(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(walk(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: walk(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: walk(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)})
    return obj


def leaves_of(obj: Any) -> list:
    out: list = []
    walk(obj, lambda t: out.append(t) or t)
    return out


def fresh_inputs(obj: Any) -> Any:
    """Independent copies of the inputs; floating tensors become leaves that require grad."""

    def f(t):
        if isinstance(t, PackedSequence):
            return t  # rebuilt by the test from its own leaves
        t = t.detach().clone()
        return t.requires_grad_(True) if t.is_floating_point() else t

    return walk(obj, f)


def as_comparable(t):
    return pad_packed_sequence(t)[0] if isinstance(t, PackedSequence) else t


def weighted_loss(out: Any) -> torch.Tensor:
    """A fixed, shape-dependent weighted sum of every floating output, so each element's gradient is distinct."""
    total = torch.zeros((), dtype=DT)
    for t in leaves_of(out):
        t = as_comparable(t)
        if t.is_floating_point() and t.requires_grad:
            w = torch.arange(t.numel(), dtype=t.dtype, device=t.device).reshape(t.shape).sin()
            total = total + (t * w).sum()
    return total


def assert_same(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, (torch.Tensor, PackedSequence)):
        torch.testing.assert_close(as_comparable(actual), as_comparable(expected))
        return
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            assert_same(actual[k], expected[k])
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(getattr(actual, f.name), getattr(expected, f.name))
    else:
        assert actual == expected


def check_against_module(factory, args, kwargs=None, n=3, expected=None, **dp_kwargs):
    """Run ``DataParallel(module, ['cpu'] * n, **dp_kwargs)`` and the plain module on copies of the same inputs;
    outputs, parameter gradients and input gradients must match. Returns the DataParallel output."""
    kwargs = kwargs or {}
    torch.manual_seed(0)
    module = factory().to(DT)
    reference = copy.deepcopy(module)
    a1, k1 = fresh_inputs((tuple(args), kwargs))
    a2, k2 = fresh_inputs((tuple(args), kwargs))
    out = dpfast.DataParallel(module, ["cpu"] * n, **dp_kwargs)(*a1, **k1)
    ref = (expected or (lambda m, *a, **k: m(*a, **k)))(reference, *a2, **k2)
    assert_same(out, ref)
    if weighted_loss(ref).requires_grad:
        weighted_loss(out).backward()
        weighted_loss(ref).backward()
        for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
        for x, y in zip(leaves_of((a1, k1)), leaves_of((a2, k2))):
            if isinstance(x, torch.Tensor) and x.requires_grad and y.grad is not None:
                torch.testing.assert_close(x.grad, y.grad)
    return out


class MLP(nn.Module):
    def __init__(self, f_in=4, f_out=3, hidden=6):
        super().__init__()
        self.l1 = nn.Linear(f_in, hidden)
        self.l2 = nn.Linear(hidden, f_out)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class Losses(nn.Module):
    """Returns (per-sample-mean loss, sum loss, predictions)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, y):
        pred = self.lin(x)
        return F.mse_loss(pred, y), ((pred - y) ** 2).sum(), pred


class PackedLSTM(nn.Module):
    """A 2-layer LSTM taking a PackedSequence (and an optional state)."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 5, num_layers=2)

    def forward(self, ps, hx=None):
        return self.lstm(ps, hx)
