"""Reliability: failing replicas, long runs, hostile input, concurrency and properties of the ops and the
planner. Everything runs on the CPU rehearsal ``device_ids=["cpu"] * n``; the CUDA test is marked."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import threading
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_sequence

import dpfast
from dpfast import reference
from dpfast.plan.splits import split_sizes

from dp_testing import MLP

DT = torch.float64
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


pytestmark = pytest.mark.usefixtures("one_thread")


def _grads(module):
    return [p.grad.clone() for p in module.parameters()]


# ---- fault injection ---------------------------------------------------------------------------------------------


class InjectedFault(RuntimeError):
    pass


class FailEveryK(nn.Module):
    """Column 0 of ``x`` holds the sample id; the replica whose chunk holds sample ``target`` raises on every k-th
    call it makes, in forward or (through a custom autograd function) in backward."""

    def __init__(self, k: int, target: int, where: str):
        super().__init__()
        self.mlp = MLP(5, 2, hidden=8)
        self.k, self.target, self.where = k, target, where
        # calls by the target replica only; a dict, shared by reference with the replicas (an int attribute set
        # by a replica's forward is the replica's own and undone at the next call, as on another GPU)
        self.counter = {"calls": 0}
        self.lock = threading.Lock()

    def forward(self, x):
        y = self.mlp(x)
        if (x[:, 0] == self.target).any():
            with self.lock:
                self.counter["calls"] += 1
                calls = self.counter["calls"]
                fail = calls % self.k == 0
            if fail and self.where == "forward":
                raise InjectedFault(f"injected forward fault on call {calls}")
            if fail and self.where == "backward":
                y = _FailInBackward.apply(y, f"injected backward fault on call {calls}")
        return y


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, message):
        ctx.message = message
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        raise InjectedFault(ctx.message)


def _batch(step: int, n_rows: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n_rows, 5, generator=g, dtype=DT)
    x[:, 0] = torch.arange(n_rows, dtype=DT)
    return x


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_fault_every_kth_call_on_one_replica_then_next_step_succeeds(where):
    torch.manual_seed(0)
    module = FailEveryK(k=3, target=4, where=where).to(DT)  # sample 4: replica 1 of chunks [3, 2, 2]
    plain = copy.deepcopy(module.mlp)
    dp = dpfast.DataParallel(module, ["cpu"] * 3)
    threads_before = threading.active_count()
    failures = 0
    for step in range(12):
        x = _batch(step)
        module.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        fails = (step + 1) % 3 == 0
        if fails and where == "forward":
            with pytest.raises(InjectedFault) as e:
                dp(x)
            # the error names the replica and device, the original is chained with its traceback
            assert str(e.value) == f"replica 1 on cpu raised InjectedFault: injected forward fault on call {step + 1}"
            assert type(e.value.__cause__) is InjectedFault and e.value.__cause__.__traceback__ is not None
            failures += 1
            continue
        out = dp(x)
        loss = (out * out).sum()
        if fails:
            # backward runs in torch's autograd engine, not in dpfast: the original exception arrives unchanged
            with pytest.raises(InjectedFault, match=f"^injected backward fault on call {step + 1}$"):
                loss.backward()
            failures += 1
            continue
        loss.backward()
        ref = plain(x)
        (ref * ref).sum().backward()
        torch.testing.assert_close(out, ref)  # the step after a failure is as good as any other
        for p, q in zip(module.mlp.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        assert threading.active_count() <= threads_before + 2  # at most the two pool workers this call needed
    assert failures == 4


def test_every_replica_failing_at_once_and_nothing_left_running():
    class AllFail(nn.Module):
        def forward(self, x):
            raise InjectedFault(f"chunk of {x.shape[0]}")

    dp = dpfast.DataParallel(AllFail(), ["cpu"] * 4)
    before = threading.active_count()
    for _ in range(20):
        with pytest.raises(
            InjectedFault,
            match=r"^replica 0 on cpu raised InjectedFault: chunk of 3 \(3 other "
            r"replicas failed too\)$",
        ):
            dp(torch.zeros(10))
    assert threading.active_count() <= before + 3
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("dpfast-worker"))


def test_failed_step_frees_the_other_replicas_outputs_without_gc():
    kept = []

    class FailOnLast(nn.Module):
        def forward(self, x):
            y = x * 2
            kept.append(weakref.ref(y))
            if x[0] == 4:
                raise InjectedFault("last replica fails")
            return y

    dp = dpfast.DataParallel(FailOnLast(), ["cpu"] * 3)
    gc.collect()
    gc.disable()
    try:
        with contextlib.suppress(InjectedFault):
            dp(torch.arange(6.0).requires_grad_())
        assert len(kept) == 3 and all(r() is None for r in kept)  # freed by reference counting alone
    finally:
        gc.enable()


@pytest.mark.cuda
def test_cuda_failing_replica_leaves_no_stream_waiting():
    torch.manual_seed(0)
    module = FailEveryK(k=2, target=4, where="forward").to(DT).cuda()
    plain = copy.deepcopy(module.mlp)
    dp = dpfast.DataParallel(module, [0, 0, 0])
    side = torch.cuda.Stream()
    for step in range(6):
        x = _batch(step).cuda()
        with torch.cuda.stream(side):
            if (step + 1) % 2 == 0:
                with pytest.raises(InjectedFault, match=r"^replica 1 on cuda:0 raised InjectedFault"):
                    dp(x)
            else:
                out = dp(x)
                torch.testing.assert_close(out, plain(x))
        side.synchronize()
        assert side.query() and torch.cuda.current_stream().query()
        event = torch.cuda.Event()
        event.record(side)
        event.synchronize()
        assert event.query()
    torch.cuda.synchronize()


# ---- soak --------------------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_soak_1000_steps_no_growth_and_gradients_match_plain_module():
    torch.manual_seed(0)
    module = MLP(4, 2, hidden=8).to(DT)
    plain = copy.deepcopy(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(7, 4, generator=g, dtype=DT), torch.randn(7, 2, generator=g, dtype=DT)) for _ in range(8)]

    class WithLoss(nn.Module):  # the loss inside the replica, reduced with "mean" weighted by chunk size
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, y):
            return ((self.m(x) - y) ** 2).mean()

    dp = dpfast.DataParallel(WithLoss(module), ["cpu"] * 3, out_dims="mean")
    threads = threading.active_count()
    objects = rss = 0
    for step in range(1000):
        x, y = data[step % len(data)]
        opt.zero_grad(set_to_none=True)
        dp(x, y).backward()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ((plain(x) - y) ** 2).mean().backward()
        ref_opt.step()
        if step == 99:  # after warm-up: caches, pool workers and optimizer state exist
            gc.collect()
            objects, rss = len(gc.get_objects()), _rss_bytes()
    gc.collect()
    grown_objects, grown_rss = len(gc.get_objects()) - objects, _rss_bytes() - rss
    print(f"soak: {grown_objects} more live objects, RSS {grown_rss / 2**20:+.2f} MiB over 900 steps")
    assert grown_objects <= 100
    assert grown_rss <= 8 * 2**20
    assert threading.active_count() <= threads + 2
    for p, q in zip(module.parameters(), plain.parameters()):
        # the chunked gradient sums in another order than the full batch: equal up to float64 rounding, after
        # 1000 steps of training in lockstep
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


# ---- the bad-input table -----------------------------------------------------------------------------------------


class Counting(nn.Module):
    """Counts its calls: a refused input must be refused before the module runs."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.lin = nn.Linear(3, 3)

    def forward(self, x, lengths=None, mask=None):
        self.calls += 1
        return x


def _ctor(**kw):
    module = kw.pop("module", None) or Counting()
    kw.setdefault("device_ids", ["cpu"] * 2)
    return dpfast.DataParallel(module, **kw)


NAN = float("nan")
CTOR_ROWS = [
    # (id, constructor kwargs, exception, regex)
    ("module-not-a-module", {"module": lambda x: x}, TypeError, r"module must be a torch\.nn\.Module, got function"),
    ("device_ids-str", {"device_ids": "cpu"}, ValueError, r"device_ids must be a non-empty sequence"),
    ("device_ids-int", {"device_ids": 3}, ValueError, r"device_ids must be a non-empty sequence"),
    ("device_ids-empty", {"device_ids": []}, ValueError, r"device_ids must be a non-empty sequence .* got \[\]"),
    ("device_ids-object", {"device_ids": object()}, TypeError, r"device_ids must be a non-empty sequence"),
    ("device_ids-None-entry", {"device_ids": ["cpu", None]}, TypeError, r"device_ids\[1\] must be an int"),
    ("device_ids-bool-entry", {"device_ids": [True]}, TypeError, r"device_ids\[0\] must be an int"),
    ("device_ids-bad-name", {"device_ids": ["cpu", "gpu"]}, ValueError, r"device_ids\[1\] is 'gpu', which is not a "),
    ("device_ids-negative", {"device_ids": [-1]}, ValueError, r"device_ids\[0\] is -1"),
    (
        "device_ids-meta",
        {"device_ids": ["meta"]},
        ValueError,
        r"device_ids\[0\] is 'meta'; dpfast\.DataParallel "
        r"runs on 'cpu' and CUDA devices",
    ),
    (
        "device_ids-mixed",
        {"device_ids": ["cpu", "cuda:0"]},
        ValueError,
        r"device_ids\[1\] is 'cuda:0' but CUDA is not available|device_ids mix device types",
    ),
    ("output_device-bad-name", {"output_device": "x"}, ValueError, r"output_device is 'x', which is not a device"),
    ("output_device-float", {"output_device": 1.5}, TypeError, r"output_device must be an int"),
    ("dim-str", {"dim": "0"}, TypeError, r"dim must be an int \(the batch axis\), got str '0'"),
    ("dim-float", {"dim": 1.0}, TypeError, r"dim must be an int"),
    ("dim-bool", {"dim": True}, TypeError, r"dim must be an int"),
    ("in_dims-bool", {"in_dims": True}, TypeError, r"in_dims must be None, an int, a sequence"),
    ("in_dims-float", {"in_dims": 0.5}, TypeError, r"in_dims must be None, an int, a sequence"),
    ("in_dims-set", {"in_dims": {0}}, TypeError, r"in_dims must be None, an int, a sequence"),
    (
        "in_dims-unknown-name",
        {"in_dims": {"y": 0}},
        TypeError,
        r"in_dims names 'y', which is not a parameter of "
        r"Counting\.forward\(x, lengths=None, mask=None\)",
    ),
    ("in_dims-non-str-key", {"in_dims": {1: 0}}, TypeError, r"in_dims keys are forward's parameter names"),
    ("in_dims-too-many", {"in_dims": (0, 0, 0, 0)}, ValueError, r"in_dims has 4 specs but .* takes 3 positional"),
    ("in_dims-reduction", {"in_dims": {"x": "sum"}}, TypeError, r"in_dims\['x'\] is the string 'sum'"),
    ("in_dims-float-leaf", {"in_dims": {"x": (0, 1.5)}}, TypeError, r"in_dims\['x'\]\[1\] is float 1\.5"),
    ("out_dims-unknown-reduction", {"out_dims": "max"}, ValueError, r"out_dims is 'max', which is not a known "),
    ("out_dims-float", {"out_dims": 1.0}, TypeError, r"out_dims is float 1\.0"),
    ("out_dims-nested-object", {"out_dims": (0, {"a": object()})}, TypeError, r"out_dims\[1\]\['a'\] is object"),
    ("chunk_sizes-str", {"chunk_sizes": "12"}, TypeError, r"chunk_sizes must be a sequence of relative weights"),
    ("chunk_sizes-length", {"chunk_sizes": [1]}, ValueError, r"chunk_sizes has 1 weights but there are 2 device_ids"),
    ("chunk_sizes-negative", {"chunk_sizes": [1, -1]}, ValueError, r"chunk_sizes\[1\] is -1; weights must be >= 0"),
    ("chunk_sizes-nan", {"chunk_sizes": [1, NAN]}, ValueError, r"chunk_sizes\[1\] is nan; weights must be finite"),
    ("chunk_sizes-inf", {"chunk_sizes": [math.inf, 1]}, ValueError, r"chunk_sizes\[0\] is inf"),
    ("chunk_sizes-zero", {"chunk_sizes": [0, 0]}, ValueError, r"chunk_sizes \[0, 0\] are all zero"),
    ("chunk_sizes-bool", {"chunk_sizes": [1, True]}, TypeError, r"chunk_sizes\[1\] is bool True"),
    ("chunk_sizes-str-entry", {"chunk_sizes": [1, "2"]}, TypeError, r"chunk_sizes\[1\] is str '2'"),
]


@pytest.mark.parametrize("kwargs, exc, pattern", [r[1:] for r in CTOR_ROWS], ids=[r[0] for r in CTOR_ROWS])
def test_bad_constructor_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _ctor(**kwargs)


def _x(*shape):
    return torch.randn(*shape)


CALL_ROWS = [
    # (id, in_dims, args, kwargs, exception, regex naming the argument)
    (
        "spec-tuple-for-tensor",
        {"x": (0, 1)},
        (_x(4, 3),),
        {},
        TypeError,
        r"in_dims for `x` is a tuple of 2 specs, but `x` is a Tensor of shape \(4, 3\)",
    ),
    (
        "spec-length-mismatch",
        {"x": (0, 1)},
        ((_x(4), _x(4), _x(4)),),
        {},
        ValueError,
        r"in_dims for `x` has 2 specs but `x` is a tuple of length 3",
    ),
    (
        "spec-dict-for-list",
        {"mask": {"a": 0}},
        (_x(4, 3),),
        {"mask": [_x(4)]},
        TypeError,
        r"in_dims for `mask` is a dict with keys \['a'\], but `mask` is a list of length 1",
    ),
    (
        "spec-unknown-key",
        {"mask": {"b": 0}},
        (_x(4, 3),),
        {"mask": {"a": _x(4)}},
        ValueError,
        r"in_dims for `mask` names \['b'\], which `mask` does not have",
    ),
    ("dim-out-of-range", {"x": 2}, (_x(4, 3),), {}, dpfast.ScatterError, r"x .* axis 2 out of range for 2 dims"),
    (
        "negative-dim-out-of-range",
        {"mask": -3},
        (_x(4, 3),),
        {"mask": _x(4, 3)},
        dpfast.ScatterError,
        r"mask .* axis -3 out of range for 2 dims",
    ),
    (
        "0-dim-under-default",
        None,
        (_x(4, 3), None, torch.tensor(1.0)),
        {},
        dpfast.ScatterError,
        r"mask .*0-dim tensor has no batch axis: replicate it with None",
    ),
    (
        "0-dim-under-explicit",
        {"mask": 0},
        (_x(4, 3),),
        {"mask": torch.tensor(1.0)},
        dpfast.ScatterError,
        r"(?s)mask .*0-dim tensor has no batch axis.*in_dims=\{'mask': None\}",
    ),
    (
        "list-under-explicit-int",
        {"lengths": 0},
        (_x(4, 3), [3, 2, 2, 1]),
        {},
        TypeError,
        r"in_dims gives `lengths\[0\]` the batch axis 0, but it is an int, not a tensor; pass it as a tensor "
        r"\(e\.g\. torch\.tensor\(\.\.\.\)\) to split it, or give it the spec None",
    ),
    (
        "str-under-explicit-int",
        {"mask": 0},
        (_x(4, 3),),
        {"mask": "causal"},
        TypeError,
        r"`mask` the batch axis 0, but it is a str",
    ),
    (
        "batch-mismatch",
        None,
        (_x(4, 3), _x(5, 3)),
        {},
        dpfast.ScatterError,
        r"(?s)B = 4.*lengths +\(5, 3\) +0 +0 +5 +<- expected 4; no axis has size 4.*in_dims=\{'lengths': None\}",
    ),
    (
        "batch-mismatch-on-axis-1",
        None,
        (_x(4, 3),),
        {"mask": _x(2, 4)},
        dpfast.ScatterError,
        r"(?s)mask +\(2, 4\) .*<- expected 4; axis 1 has size 4.*in_dims=\{'mask': 1\}",
    ),
    (
        "packed-mismatch",
        None,
        (_x(4, 3), pack_sequence([_x(2, 1), _x(1, 1)])),
        {},
        dpfast.ScatterError,
        r"lengths +packed\(B=2",
    ),
    (
        "meta-tensor",
        None,
        (torch.zeros(4, 3, device="meta"),),
        {},
        ValueError,
        r"`x` is on meta, but device_ids are \['cpu', 'cpu'\]; inputs must be on the CPU",
    ),
    (
        "meta-tensor-replicated",
        {"mask": None},
        (_x(4, 3),),
        {"mask": torch.zeros(3, device="meta")},
        ValueError,
        r"`mask` is on meta",
    ),
]


@pytest.mark.parametrize(
    "in_dims, args, kwargs, exc, pattern", [r[1:] for r in CALL_ROWS], ids=[r[0] for r in CALL_ROWS]
)
def test_bad_inputs_refused_before_the_module_runs(in_dims, args, kwargs, exc, pattern):
    module = Counting()
    dp = dpfast.DataParallel(module, ["cpu"] * 2, in_dims=in_dims)
    with pytest.raises(exc, match=pattern):
        dp(*args, **kwargs)
    with pytest.raises(exc, match=pattern):
        dp.plan(*args, **kwargs)  # plan() refuses the same inputs the same way
    assert module.calls == 0


@pytest.mark.cuda
def test_cuda_tensor_in_cpu_rehearsal_is_refused():
    module = Counting()
    with pytest.raises(ValueError, match=r"`x` is on cuda:0, but device_ids are \['cpu', 'cpu'\]"):
        dpfast.DataParallel(module, ["cpu"] * 2)(torch.zeros(4, 3, device="cuda"))
    assert module.calls == 0


def test_out_dims_mismatch_is_refused_at_gather_naming_the_output():
    # outputs exist only after the replicas ran, so out_dims structure is checked then, before anything is gathered
    dp = dpfast.DataParallel(Counting(), ["cpu"] * 2, out_dims=(0, 1))
    with pytest.raises(TypeError, match=r"out_dims for `output` is a tuple of 2 specs, but `output` is a Tensor"):
        dp(_x(4, 3))
    with pytest.raises(ValueError, match=r"output `output` cannot be concatenated along axis 5"):
        dpfast.DataParallel(Counting(), ["cpu"] * 2, out_dims=5)(_x(4, 3))


def test_non_tensors_under_default_dim_pass_by_reference():
    seen = []

    class M(nn.Module):
        def forward(self, x, lengths, mask=None):
            seen.append((lengths, mask))
            return x

    lengths, cfg = [3, 2, 2, 1], {"causal": True}
    dpfast.DataParallel(M(), ["cpu"] * 2)(_x(4, 3), lengths, cfg)
    assert len(seen) == 2 and all(a is lengths and b is cfg for a, b in seen)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(
        torch.int64
        if t.element_size() == 8
        else torch.int32
        if t.element_size() == 4
        else torch.int16
        if t.element_size() == 2
        else torch.uint8
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_nan_and_inf_pass_through_bit_exact(dtype):
    x = torch.tensor(
        [
            [math.nan, -math.nan],
            [math.inf, -math.inf],
            [-0.0, 0.0],
            [1e-40, -1e-40],
            [3.0, 1.0],
            [math.nan, 7.0],
            [math.inf, math.nan],
        ],
        dtype=torch.float64,
    ).to(dtype)
    x[0, 0] = torch.tensor(0x7FF0000000000123, dtype=torch.int64).view(torch.float64).to(dtype)  # a payload NaN
    mask = torch.tensor([math.nan, math.inf], dtype=dtype)

    class M(nn.Module):
        def forward(self, x, mask):
            return x, mask, x.t()

    dp = dpfast.DataParallel(M(), ["cpu"] * 3, in_dims={"mask": None}, out_dims=(0, None, 1))
    out, m, xt = dp(x, mask)
    assert torch.equal(_bits(out), _bits(x)) and torch.equal(_bits(m), _bits(mask))
    assert torch.equal(_bits(xt), _bits(x.t()))


def test_zero_size_dims():
    dp = dpfast.DataParallel(nn.Identity(), ["cpu"] * 3)
    for shape in [(7, 0), (7, 0, 3), (5, 2, 0)]:
        x = torch.randn(*shape)
        assert dp(x).shape == x.shape
    module = Counting()
    out = dpfast.DataParallel(module, ["cpu"] * 3)(torch.zeros(0, 3))  # B == 0: one call on device_ids[0]
    assert out.shape == (0, 3) and module.calls == 1
    assert "B = 0" in str(dpfast.DataParallel(module, ["cpu"] * 3).plan(torch.zeros(0, 3)))
    out = dpfast.DataParallel(nn.Identity(), ["cpu"] * 3, dim=1)(torch.zeros(0, 5))  # B = 5, rows of size 0
    assert out.shape == (0, 5)


def test_huge_dims():
    n = 7
    x = torch.arange(2**20 + 3, dtype=torch.int32)
    assert torch.equal(dpfast.DataParallel(nn.Identity(), ["cpu"] * n)(x), x)
    plan = dpfast.DataParallel(nn.Identity(), ["cpu"] * n).plan(torch.zeros(1, 3).expand(2**40, 3))
    assert sum(plan.sizes) == 2**40 and max(plan.sizes) - min(plan.sizes) <= 1  # planned, nothing allocated
    sizes = split_sizes(2**62 + 5, 5, [1, 2, 2, 2, 0])
    assert sum(sizes) == 2**62 + 5 and sizes[-1] == 0


# ---- properties: ops and planner ---------------------------------------------------------------------------------

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex64,
]


@st.composite
def tensors(draw, min_dims=1, max_dims=4):
    shape = draw(st.lists(st.integers(0, 5), min_size=min_dims, max_size=max_dims))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if dtype.is_floating_point or dtype.is_complex:
        t = (
            torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
            if not dtype.is_complex
            else torch.randn(*shape, generator=g, dtype=dtype)
        )
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=g).bool()
    else:
        t = torch.randint(-100, 100, shape, generator=g, dtype=dtype)
    if len(shape) >= 2 and draw(st.booleans()):  # non-contiguous: same values, transposed storage
        t = t.transpose(0, -1).contiguous().transpose(0, -1)
    return t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.device == b.device and torch.equal(a, b)


@st.composite
def split_case(draw):
    t = draw(tensors())
    dim = draw(st.integers(-t.dim(), t.dim() - 1))
    n = draw(st.integers(1, 5))
    b = t.shape[dim]
    cuts = sorted(draw(st.lists(st.integers(0, b), min_size=n - 1, max_size=n - 1)))
    sizes = [e - s for s, e in zip([0] + cuts, cuts + [b])]
    others = [t.new_zeros(tuple(s if i != dim % t.dim() else b for i, s in enumerate(t.shape))) for _ in range(2)]
    return t, dim, sizes, others


@PROPS
@given(split_case())
def test_property_split_and_scatter_bit_exact_and_gather_inverts(case):
    t, dim, sizes, others = case
    tensors_ = [t] + others
    got = dpfast.ops.split_contiguous(tensors_, dim, sizes)
    want = reference.split_contiguous(tensors_, dim, sizes)
    for row_g, row_w in zip(got, want):
        for a, b in zip(row_g, row_w):
            assert _same(a, b) and a.is_contiguous()
    devices = ["cpu"] * len(sizes)
    got = dpfast.ops.scatter(tensors_, dim, sizes, devices)
    want = reference.scatter(tensors_, dim, sizes, devices)
    for row_g, row_w in zip(got, want):
        for a, b in zip(row_g, row_w):
            assert _same(a, b) and a.is_contiguous()
    back = dpfast.ops.gather(got[0], dim, "cpu")
    assert _same(back, t.contiguous()) and _same(back, reference.gather(got[0], dim, "cpu"))
    assert back.data_ptr() != t.data_ptr() or t.numel() == 0  # never an alias of the input


@PROPS
@given(st.lists(tensors(min_dims=2), min_size=1, max_size=3))
def test_property_transpose01_bit_exact(ts):
    for a, b in zip(dpfast.ops.transpose01(*ts), reference.transpose01(*ts)):
        assert _same(a, b) and a.is_contiguous()


@PROPS
@given(st.integers(0, 10**6), st.integers(1, 16))
def test_property_even_split_sums_and_differs_by_at_most_one(batch, n):
    sizes = split_sizes(batch, n)
    assert len(sizes) == n and sum(sizes) == batch and min(sizes) >= 0
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier devices take the remainder


@PROPS
@given(
    st.integers(0, 10**6),
    st.lists(st.one_of(st.integers(0, 8), st.floats(0, 8)), min_size=1, max_size=12).filter(lambda w: sum(w) > 0),
)
def test_property_weighted_split_sums_and_is_proportional(batch, weights):
    ws = dpfast.DataParallel(nn.Identity(), ["cpu"] * len(weights), chunk_sizes=weights)._weights
    sizes = split_sizes(batch, len(weights), ws)
    assert sum(sizes) == batch and all(s >= 0 for s in sizes)
    total = sum(ws)
    for s, w in zip(sizes, ws):
        assert abs(s - batch * w / total) < 1  # largest remainder: within one of the exact share
        if w == 0:
            assert s == 0


@st.composite
def dp_case(draw):
    t = draw(tensors())
    dim = draw(st.integers(-t.dim(), t.dim() - 1))
    n = draw(st.integers(1, 5))
    weights = draw(
        st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=n, max_size=n).filter(lambda w: sum(w) > 0))
    )
    return t, dim, n, weights


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dp_case())
def test_property_data_parallel_identity_and_plan(case):
    t, dim, n, weights = case
    seen = []

    class Record(nn.Module):
        def forward(self, x):
            seen.append(x.shape[dim])
            return x

    dp = dpfast.DataParallel(Record(), ["cpu"] * n, dim=dim, chunk_sizes=weights)
    plan = dp.plan(t)
    out = dp(t)
    assert _same(out, t.contiguous() if n > 1 else t)  # scatter -> replicas -> gather is the identity, bit-exact
    b = t.shape[dim]
    if n > 1 and b > 0:
        assert sum(plan.sizes) == b and sorted(seen) == sorted(s for s in plan.sizes if s > 0)
        if weights is None:
            assert max(plan.sizes) - min(plan.sizes) <= 1


# ---- thread safety -----------------------------------------------------------------------------------------------


def test_two_instances_from_two_threads_at_once():
    torch.manual_seed(0)
    cases = []
    for n, rows in [(2, 9), (3, 7)]:
        module = MLP(4, 2, hidden=8).to(DT)
        xs = [torch.randn(rows, 4, dtype=DT) for _ in range(4)]
        expected = []
        for x in xs:
            out = module(x)
            grads = torch.autograd.grad(out.square().sum(), list(module.parameters()))
            expected.append((out.detach(), grads))
        cases.append((dpfast.DataParallel(module, ["cpu"] * n), module, xs, expected))
    shared = dpfast.DataParallel(MLP(4, 2, hidden=8).to(DT), ["cpu"] * 2)  # and one instance shared by both threads
    shared_x = torch.randn(5, 4, dtype=DT)
    shared_expected = shared.module(shared_x).detach()

    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(case):
        dp, module, xs, expected = case
        try:
            barrier.wait()
            for step in range(30):
                x = xs[step % len(xs)]
                out = dp(x)
                grads = torch.autograd.grad(out.square().sum(), list(module.parameters()))
                want_out, want_grads = expected[step % len(xs)]
                torch.testing.assert_close(out, want_out)
                for a, b in zip(grads, want_grads):
                    torch.testing.assert_close(a, b)
                torch.testing.assert_close(shared(shared_x), shared_expected)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
