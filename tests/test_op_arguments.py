"""Argument handling of the fused ops is the same on every path: dpfast.ops (the direct C entry points), the
torch.ops.dpfast path, the fake kernels (FakeTensor / meta) and dpfast.reference raise the same exception type
with the same message, and accept the same argument types."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dpfast
from dpfast import ops
from dpfast import reference as ref

from dp_testing import assert_bitexact

needs_ext = pytest.mark.skipif(not dpfast.build_info()["extension_loaded"], reason="dpfast._C not built")

meta = torch.empty(2, 3, device="meta")

# (name, op, args): each row must raise on every path, with one type and one message. (The sizes that overflow
# 64 bits are in test_memory_safety.py, in subprocesses: a regression there crashes the process.)
ERRORS = [
    ("transpose01 1-dim", "transpose01", lambda: (torch.randn(3),)),
    ("transpose01 two devices", "transpose01", lambda: (torch.randn(2, 3), meta)),
    ("split sum", "split_contiguous", lambda: ([torch.randn(5, 2)], 0, [2, 2])),
    ("split negative", "split_contiguous", lambda: ([torch.randn(5, 2)], 0, [6, -1])),
    ("split dim high", "split_contiguous", lambda: ([torch.randn(5, 2)], 2, [5])),
    ("split dim low", "split_contiguous", lambda: ([torch.randn(5, 2)], -3, [5])),
    ("split second tensor", "split_contiguous", lambda: ([torch.randn(5, 2), torch.randn(4, 2)], 0, [5])),
    ("split 0-dim", "split_contiguous", lambda: ([torch.tensor(1.0)], 0, [1])),
    ("split two devices", "split_contiguous", lambda: ([torch.randn(2, 3), meta], 0, [1, 1])),
    ("scatter sizes vs devices", "scatter", lambda: ([torch.randn(5, 2)], 0, [2, 3], [torch.device("cpu")])),
    ("scatter meta to cpu", "scatter", lambda: ([meta], 0, [1, 1], [torch.device("cpu"), torch.device("meta")])),
    ("gather shapes", "gather", lambda: ([torch.randn(2, 3), torch.randn(2, 4)], 0, torch.device("cpu"))),
    ("gather dtypes", "gather", lambda: ([torch.randn(2, 3), torch.randn(2, 3).double()], 0, torch.device("cpu"))),
    ("gather 0-dim", "gather", lambda: ([torch.randn(2), torch.tensor(1.0)], 0, torch.device("cpu"))),
    ("gather dim", "gather", lambda: ([torch.randn(2, 3)], 2, torch.device("cpu"))),
    ("gather meta to cpu", "gather", lambda: ([torch.randn(2, 3), meta], 0, torch.device("cpu"))),
]

# rows whose argument *types* are wrong: torch.ops.dpfast checks types against its schema (its own messages), the
# Python paths convert and refuse alike
TYPE_ERRORS = [
    ("bool dim", "split_contiguous", lambda: ([torch.randn(4, 2)], True, [2, 2])),
    ("float dim", "gather", lambda: ([torch.randn(4, 2)], 0.0, "cpu")),
    ("float sizes", "split_contiguous", lambda: ([torch.randn(4, 2)], 0, [2.0, 2.0])),
    ("string sizes", "scatter", lambda: ([torch.randn(4, 2)], 0, ["2", "2"], ["cpu", "cpu"])),
    ("sizes not a sequence", "split_contiguous", lambda: ([torch.randn(4, 2)], 0, 4)),
    ("bool size", "split_contiguous", lambda: ([torch.randn(4, 2)], 0, [True, 3])),
    ("device float", "gather", lambda: ([torch.randn(4, 2)], 0, 1.5)),
    ("not a tensor", "gather", lambda: ([torch.randn(4, 2), [1, 2]], 0, "cpu")),
    ("not a tensor in split", "split_contiguous", lambda: ([torch.randn(4, 2), 3], 0, [2, 2])),
]


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return type(e), str(e)
    return None


def _python_paths(op, args):
    yield "dpfast.ops", lambda: getattr(ops, op)(*args)
    yield "reference", lambda: getattr(ref, op)(*args)
    if dpfast.build_info()["extension_loaded"]:

        def boxed():  # the wrapper's torch.ops path, as torch.compile takes it
            saved = ops._compiling
            ops._compiling = lambda: True
            try:
                return getattr(ops, op)(*args)
            finally:
                ops._compiling = saved

        yield "dpfast.ops via torch.ops", boxed


def _schema_args(op, args):
    """The arguments as the schema takes them (a tuple of tensors for transpose01)."""
    return (list(args),) if op == "transpose01" else args


@pytest.mark.parametrize("name,op,args", ERRORS, ids=[e[0] for e in ERRORS])
def test_value_errors_agree_on_every_path(name, op, args):
    args = args()
    outcomes = {path: _outcome(fn) for path, fn in _python_paths(op, args)}
    if dpfast.build_info()["extension_loaded"]:
        outcomes["torch.ops.dpfast"] = _outcome(lambda: getattr(torch.ops.dpfast, op)(*_schema_args(op, args)))
        # the fake kernels, as torch.compile runs them: the same checks with the same messages
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:

            def to_fake(a):
                if isinstance(a, list):
                    return [to_fake(t) for t in a]
                return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a

            fake = [to_fake(a) for a in _schema_args(op, args)]
            outcomes["fake kernel"] = _outcome(lambda: getattr(torch.ops.dpfast, op)(*fake))
    first = outcomes["reference"]
    assert first is not None, "the reference accepted it"
    for path, got in outcomes.items():
        assert got == first, f"{path}: {got}\nreference: {first}"


@pytest.mark.parametrize("name,op,args", TYPE_ERRORS, ids=[e[0] for e in TYPE_ERRORS])
def test_type_errors_agree_on_python_paths(name, op, args):
    args = args()
    outcomes = {path: _outcome(fn) for path, fn in _python_paths(op, args)}
    first = outcomes["reference"]
    assert first is not None and first[0] is TypeError, first
    for path, got in outcomes.items():
        assert got == first, f"{path}: {got}\nreference: {first}"


def test_integer_like_arguments_are_accepted_alike():
    x = torch.arange(12.0).view(4, 3)
    for fn in (ops, ref):
        parts = fn.split_contiguous([x], np.int64(1), (np.int64(1), 2))[0]
        assert torch.equal(parts[1], x[:, 1:])
        parts = fn.scatter([x], torch.tensor(0), range(1, 4, 2), ["cpu", torch.device("cpu")])[0]
        assert torch.equal(parts[1], x[1:])
        assert torch.equal(fn.gather([x, x], np.int32(-1), "cpu"), torch.cat([x, x], 1))


@pytest.mark.parametrize(
    "dtype,bits", [(torch.float16, torch.int16), (torch.bfloat16, torch.int16), (torch.float32, torch.int32)]
)
def test_negated_and_conjugated_views_are_bit_identical(dtype, bits):
    """A lazily negated view of signalling NaNs: torch's fallback for the Negative key quiets them differently
    from Tensor.resolve_neg(), so both sides resolve the view the same way."""
    g = torch.Generator().manual_seed(0)
    lo, hi = -(2 ** (8 * bits.itemsize - 1)), 2 ** (8 * bits.itemsize - 1) - 1
    raw = torch.randint(lo, hi, (1000, 3), generator=g, dtype=torch.int64).to(bits).view(dtype)
    views = [torch._neg_view(raw), torch._neg_view(raw.t().contiguous().t())]
    cplx = torch.complex(raw.float(), raw.float()).conj()  # a conjugation bit

    for v in views + [cplx]:
        assert v.is_neg() or v.is_conj()
        assert_bitexact(ops.transpose01(v)[0], ref.transpose01(v)[0])
        if dpfast.build_info()["extension_loaded"]:  # (the dispatcher's path: the extension's alone)
            assert_bitexact(torch.ops.dpfast.transpose01([v])[0], ref.transpose01(v)[0])
        for a, b in zip(ops.split_contiguous([v], 0, [500, 500])[0], ref.split_contiguous([v], 0, [500, 500])[0]):
            assert_bitexact(a, b)
        assert_bitexact(ops.gather([v, v], 1, "cpu"), ref.gather([v, v], 1, "cpu"))


def test_fake_gather_checks_shapes_and_dtypes():
    """The fake kernel used to accept chunks the real kernel refuses."""
    with pytest.raises(ValueError, match=r"chunks\[1\] has shape \(2, 4\)"):
        ops.gather([torch.empty(2, 3, device="meta"), torch.empty(2, 4, device="meta")], 0, "meta")
    with pytest.raises(ValueError, match="dtype torch.float64"):
        ops.gather([torch.empty(2, 3, device="meta"), torch.empty(2, 3, device="meta").double()], 0, "meta")
    out = ops.gather([torch.empty(2, 3, device="meta"), torch.empty(1, 3, device="meta")], 0, "meta")
    assert out.shape == (3, 3) and out.device.type == "meta"


def test_integer_chunk_weights_of_any_kind():
    """np.int64 weights were refused while np.float64 ones were accepted."""
    m = torch.nn.Linear(3, 2)
    x = torch.randn(6, 3)
    for weights in ([np.int64(1), np.int64(2)], [np.float64(1), np.float64(2)], [1, 2], [np.int32(1), 2.0]):
        dp = dpfast.DataParallel(m, ["cpu"] * 2, chunk_sizes=weights)
        assert dp.plan(x).sizes == [2, 4]
        torch.testing.assert_close(dp(x), m(x))
    with pytest.raises(TypeError, match=r"chunk_sizes\[0\] is bool"):
        dpfast.DataParallel(m, ["cpu"] * 2, chunk_sizes=[True, 1])


def test_plan_without_devices_raises_nothing_the_call_does_not(monkeypatch):
    """With device_ids=None and no CUDA the module is called directly, ignoring in_dims; plan() used to raise
    in_dims structure errors that the call does not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    class M(torch.nn.Module):
        def forward(self, x, h):
            return x

    dp = dpfast.DataParallel(M(), in_dims={"h": (1, 1)})
    x, h = torch.randn(4, 3), torch.randn(2, 4)  # h is not a pair: the spec does not match
    assert torch.equal(dp(x, h), x)
    plan = dp.plan(x, h)
    assert plan.mode == "passthrough" and "called directly" in str(plan)
