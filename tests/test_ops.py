"""dpfast.ops against dpfast.reference: bit-exact results, autograd, fake kernels, errors."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dpfast
from dpfast import ops
from dpfast import reference as ref

from dp_testing import assert_bitexact

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.uint8,
]
needs_ext = pytest.mark.skipif(not dpfast.build_info()["extension_loaded"], reason="dpfast._C not built")


def make(shape, dtype, device, layout="contiguous", seed=0):
    """A tensor of `shape` whose memory layout is `layout`: contiguous, transposed, sliced or expanded."""
    g = torch.Generator().manual_seed(seed)
    if layout == "transposed" and len(shape) >= 2:
        return make(shape[::-1], dtype, device, seed=seed).permute(*reversed(range(len(shape))))
    if layout == "sliced":
        big = make([2 * s + 1 for s in shape], dtype, device, seed=seed)
        return big[tuple(slice(1, 1 + 2 * s, 2) for s in shape)]
    if layout == "expanded" and len(shape) >= 1:
        return make([1] + list(shape[1:]), dtype, device, seed=seed).expand(*shape)
    if dtype == torch.bool:
        x = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_complex:
        x = torch.randn(shape, generator=g, dtype=torch.float32) * (1 + 2j)
        x = x.to(dtype)
    elif dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
    else:
        x = (
            torch.randint(-1000, 1000, shape, generator=g).to(dtype)
            if dtype != torch.uint8
            else torch.randint(0, 255, shape, generator=g, dtype=torch.uint8)
        )
    return x.to(device)


def assert_fresh(out, inputs):
    """Outputs never alias inputs (or each other)."""
    ptrs = {x.untyped_storage().data_ptr() for x in inputs if x.numel()}
    for o in out:
        if o.numel():
            assert o.untyped_storage().data_ptr() not in ptrs


SHAPES = [(3, 4), (1, 5), (5, 1), (0, 3), (3, 0), (2, 3, 4), (4, 1, 7), (2, 3, 4, 5), (3, 2, 1, 2, 3), (6, 5, 33)]
LAYOUTS = ["contiguous", "transposed", "sliced", "expanded"]


# ---- transpose01 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_transpose01_matches_reference(device, dtype, layout):
    xs = [make(s, dtype, device, layout, seed=i) for i, s in enumerate(SHAPES)]
    out = ops.transpose01(*xs)
    assert isinstance(out, tuple) and len(out) == len(xs)
    for o, r in zip(out, ref.transpose01(*xs)):
        assert_bitexact(o, r)
    assert_fresh(out, xs)


def test_transpose01_mixed_dtypes_one_call(device):
    xs = [make((2, 3, 4), d, device, seed=k) for k, d in enumerate(DTYPES)]
    for o, r in zip(ops.transpose01(*xs), ref.transpose01(*xs)):
        assert_bitexact(o, r)


def test_transpose01_contiguous_input_is_copied(device):
    x = make((3, 3, 3), torch.float32, device)
    (o,) = ops.transpose01(x.transpose(0, 1))  # already (transposed) contiguous: still a fresh tensor
    assert torch.equal(o, x) and o.data_ptr() != x.data_ptr()


def test_state_helpers(device):
    h, c = make((2, 5, 8), torch.float32, device), make((2, 5, 8), torch.float32, device, seed=1)
    hb, cb = ops.state_to_batch_first((h, c))
    assert hb.shape == (5, 2, 8) and torch.equal(hb, h.transpose(0, 1)) and torch.equal(cb, c.transpose(0, 1))
    h2, c2 = ops.state_to_layer_first((hb, cb))
    assert torch.equal(h2, h) and torch.equal(c2, c)
    g = ops.state_to_batch_first(h)
    assert isinstance(g, torch.Tensor) and torch.equal(g, ref.state_to_batch_first(h))
    hl = ops.state_to_batch_first([h, c])  # a list (as code ported from permute loops builds) stays a list
    assert isinstance(hl, list) and torch.equal(hl[0], hb) and torch.equal(hl[1], cb)
    with pytest.raises(TypeError, match="state must be a Tensor"):
        ops.state_to_batch_first({"h": h})


# ---- split_contiguous / scatter / gather -----------------------------------------------------------------------


def random_sizes(n, parts, rng):
    cuts = sorted(rng.randint(0, n) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [n])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_contiguous_matches_reference(device, dtype, layout):
    rng = random.Random(hash((str(dtype), layout)) % 1000)
    for shape in SHAPES:
        for dim in range(-len(shape), len(shape)):
            xs = [make(shape, dtype, device, layout, seed=k) for k in range(3)]
            sizes = random_sizes(shape[dim], rng.randint(1, 5), rng)
            out = ops.split_contiguous(xs, dim, sizes)
            expect = ref.split_contiguous(xs, dim, sizes)
            assert len(out) == 3 and all(len(row) == len(sizes) for row in out)
            for row, erow in zip(out, expect):
                for o, e in zip(row, erow):
                    assert_bitexact(o, e)
                assert_fresh(row, xs)


def test_negative_dim_wraps_per_tensor(device):
    """Tensors of different rank: dim -2 is axis 0 of a (5, 3) and axis 1 of a (2, 5, 3) (it was wrapped once,
    for the last tensor, which split the first along the wrong axis and read past its end)."""
    xs = [make((5, 3), torch.float32, device), make((2, 5, 3), torch.float32, device, "transposed", seed=1)]
    for fn, args in ((ops.split_contiguous, ()), (ops.scatter, ([device] * 2,))):
        for row, erow in zip(fn(xs, -2, [2, 3], *args), ref.split_contiguous(xs, -2, [2, 3])):
            for o, e in zip(row, erow):
                assert_bitexact(o, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.complex64])
def test_scatter_gather_roundtrip(device, dtype):
    x = make((7, 4, 3), dtype, device, "transposed")
    y = make((7, 2), dtype, device)
    for dim in (0, -3):
        sizes = [3, 0, 2, 2]
        parts = ops.scatter([x, y], 0 if dim == -3 else dim, sizes, [device] * 4)
        expect = ref.scatter([x, y], 0, sizes, [device] * 4)
        for row, erow in zip(parts, expect):
            for o, e in zip(row, erow):
                assert_bitexact(o, e)
        assert_bitexact(ops.gather(parts[0], dim, device), x.contiguous())
        assert_bitexact(ops.gather(parts[1], 0, device), y)


def test_gather_matches_reference(device):
    chunks = [make((2, k, 3), torch.float64, device, seed=k) for k in (0, 1, 4)]
    chunks[2] = chunks[2].transpose(0, 2).contiguous().transpose(0, 2)  # non-contiguous chunk
    assert_bitexact(ops.gather(chunks, 1, device), ref.gather(chunks, 1, device))
    assert_bitexact(ops.gather(chunks, -2, "cpu"), ref.gather(chunks, -2, "cpu"))


def test_devices_as_int_str_device():
    x = torch.arange(6.0).view(3, 2)
    for devs in (["cpu", "cpu"], [torch.device("cpu")] * 2):
        parts = ops.scatter([x], 0, [1, 2], devs)
        assert [p.device.type for p in parts[0]] == ["cpu", "cpu"]
    assert ops.as_device(1) == torch.device("cuda", 1)
    with pytest.raises(TypeError, match="expected a device"):
        ops.as_device(1.5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
)
def test_property_split_then_gather_is_identity(shape, data, dtype, layout):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    n = data.draw(st.integers(1, 5))
    weights = data.draw(st.lists(st.integers(0, shape[dim]), min_size=n - 1, max_size=n - 1))
    cuts = sorted(weights)
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [shape[dim]])]
    x = make(shape, dtype, "cpu", layout)
    parts = ops.split_contiguous([x], dim, sizes)[0]
    for o, e in zip(parts, ref.split_contiguous([x], dim, sizes)[0]):
        assert_bitexact(o, e)
    assert_bitexact(ops.gather(parts, dim, "cpu"), x.contiguous())
    if len(shape) >= 2:
        assert_bitexact(ops.transpose01(x)[0], ref.transpose01(x)[0])


# ---- autograd, opcheck, compile --------------------------------------------------------------------------------


def test_gradcheck_all_ops(device):
    x = torch.randn(5, 3, 2, dtype=torch.float64, device=device, requires_grad=True)
    y = torch.randn(5, 4, dtype=torch.float64, device=device, requires_grad=True)
    fwd = {"check_forward_ad": True}  # forward-mode AD too
    assert torch.autograd.gradcheck(lambda a, b: ops.transpose01(a, b), (x, y), **fwd)
    assert torch.autograd.gradcheck(
        lambda a, b: tuple(sum(ops.split_contiguous([a, b], 0, [2, 0, 3]), [])), (x, y), **fwd
    )
    assert torch.autograd.gradcheck(lambda a: tuple(ops.scatter([a], 1, [1, 2], [device] * 2)[0]), (x,), **fwd)
    assert torch.autograd.gradcheck(
        lambda a, b: ops.gather([a, b[:, :3].unsqueeze(-1).expand(5, 3, 2)], 1, device), (x, y), **fwd
    )
    assert torch.autograd.gradgradcheck(lambda a: ops.transpose01(a)[0] * a.transpose(0, 1), (x,))
    assert torch.autograd.gradgradcheck(
        lambda a: ops.gather(ops.split_contiguous([a], 2, [1, 1])[0], 2, device) * a, (x,)
    )


def test_backward_with_unused_outputs_and_int_tensors(device):
    x = torch.randn(4, 3, device=device, requires_grad=True)
    i = torch.arange(12, device=device).view(4, 3)
    tx, ti = ops.transpose01(x, i)
    assert tx.requires_grad and not ti.requires_grad
    tx.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    x.grad = None
    parts = ops.scatter([x], 0, [1, 3], [device] * 2)[0]
    (parts[1] * 2).sum().backward()  # chunk 0 unused: its gradient is zero
    assert torch.equal(x.grad, torch.tensor([[0.0] * 3] + [[2.0] * 3] * 3, device=device))


def test_outputs_of_inputs_without_grad_do_not_require_grad(device):
    """A mask split or transposed alongside x keeps requires_grad=False, as with the reference."""
    x = torch.randn(4, 3, device=device, requires_grad=True)
    m = torch.randn(4, 3, device=device)
    for fn in (ops, ref):
        assert [t.requires_grad for t in fn.transpose01(x, m)] == [True, False]
        parts = fn.scatter([m, x], 0, [1, 3], [device] * 2)
        assert [[t.requires_grad for t in row] for row in parts] == [[False, False], [True, True]]
        assert fn.gather([m, x], 0, device).requires_grad
    parts = ops.split_contiguous([m, x], 1, [2, 1])
    (parts[1][0].sum() * 2 + parts[1][1].sum()).backward()
    assert torch.equal(x.grad, torch.tensor([[2.0, 2.0, 1.0]] * 4, device=device))


def test_forward_mode_ad(device):
    """Tangents pass through every op (they were silently dropped: tangent None)."""
    import torch.autograd.forward_ad as fwAD

    x, tx = torch.randn(4, 3, 2, device=device), torch.randn(4, 3, 2, device=device)
    y = torch.randn(4, 5, device=device)
    with fwAD.dual_level():
        dx = fwAD.make_dual(x, tx)
        a, b = ops.transpose01(dx, y)
        assert torch.equal(fwAD.unpack_dual(a).tangent, tx.transpose(0, 1))
        assert fwAD.unpack_dual(b).tangent is None
        parts = ops.split_contiguous([y, dx], 0, [1, 3])
        assert fwAD.unpack_dual(parts[0][0]).tangent is None
        assert torch.equal(fwAD.unpack_dual(parts[1][1]).tangent, tx[1:])
        parts = ops.scatter([dx], 1, [2, 1], [device] * 2)[0]
        assert torch.equal(fwAD.unpack_dual(parts[0]).tangent, tx[:, :2])
        g = ops.gather([x[:, :1], dx, x], 1, device)  # chunks without a tangent contribute zeros
        assert torch.equal(fwAD.unpack_dual(g).tangent, torch.cat([torch.zeros_like(x[:, :1]), tx, 0 * x], 1))
    jvp = torch.func.jvp(lambda t: ops.transpose01(t)[0], (x,), (tx,))[1]
    assert torch.equal(jvp, tx.transpose(0, 1))


@needs_ext
@pytest.mark.parametrize(
    "op,args",
    [
        ("transpose01", lambda d: ([torch.randn(3, 4, 2, device=d, requires_grad=True), torch.randn(2, 5, device=d)],)),
        ("split_contiguous", lambda d: ([torch.randn(5, 3, device=d, requires_grad=True)], 0, [2, 3])),
        ("scatter", lambda d: ([torch.randn(2, 6, device=d, requires_grad=True)], 1, [4, 2], [torch.device(d)] * 2)),
        (
            "gather",
            lambda d: (
                [torch.randn(2, 3, device=d, requires_grad=True), torch.randn(2, 1, device=d)],
                1,
                torch.device(d),
            ),
        ),
    ],
)
def test_opcheck(device, op, args):
    torch.library.opcheck(getattr(torch.ops.dpfast, op).default, args(device))


@needs_ext
def test_compile_fullgraph_with_backward():
    def f(h, c):
        hb, cb = ops.transpose01(h, c)
        return (hb * 2 + cb).sum()

    h = torch.randn(2, 4, 3, requires_grad=True)
    c = torch.randn(2, 4, 3, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(h, c)
    loss.backward()
    assert torch.equal(loss, f(h.detach(), c.detach()))
    assert torch.equal(h.grad, torch.full_like(h, 2.0)) and torch.equal(c.grad, torch.ones_like(c))


# ---- errors ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: ops.transpose01(torch.randn(3)), ValueError, r"tensors\[0\] has shape \(3,\).*at least 2 dims"),
        (lambda: ops.split_contiguous([torch.randn(5, 2)], 0, [2, 2]), ValueError, r"sum to 4.*size 5 along dim 0"),
        (lambda: ops.split_contiguous([torch.randn(5, 2)], 0, [6, -1]), ValueError, r"sizes\[1\] is -1"),
        (lambda: ops.split_contiguous([torch.randn(5, 2)], 2, [5]), IndexError, r"dim 2 is out of range.*\[-2, 1\]"),
        (lambda: ops.split_contiguous([torch.randn(5, 2)], -3, [5]), IndexError, r"dim -3 is out of range"),
        (
            lambda: ops.split_contiguous([torch.randn(5, 2), torch.randn(4, 2)], 0, [5]),
            ValueError,
            r"tensors\[1\] has size 4",
        ),
        (lambda: ops.scatter([torch.randn(5, 2)], 0, [2, 3], ["cpu"]), ValueError, r"2 sizes but 1 devices"),
        (lambda: ops.gather([], 0, "cpu"), ValueError, r"chunks is empty"),
        (
            lambda: ops.gather([torch.randn(2, 3), torch.randn(2, 4)], 0, "cpu"),
            ValueError,
            r"chunks\[1\] has shape \(2, 4\)",
        ),
        (lambda: ops.gather([torch.randn(2, 3), torch.randn(2, 3).double()], 0, "cpu"), ValueError, r"dtype"),
        (lambda: ops.split_contiguous([torch.tensor(1.0)], 0, [1]), ValueError, r"0-dim"),
    ],
)
@pytest.mark.parametrize("path", ["fast", "torch.ops"])
def test_errors(call, exc, match, path, monkeypatch):
    """The same error, type and message, from the direct entry point and from the torch.ops path."""
    if path == "torch.ops":
        monkeypatch.setattr(ops, "_compiling", lambda: True, raising=False)  # what torch.compile traces
    with pytest.raises(exc, match=match):
        call()


# ---- the direct call path (csrc/python_calls.cpp) ------------------------------------------------------------


@needs_ext
def test_fast_path_takes_plain_tensors_and_parameters():
    from dpfast.ext.loader import C

    x = torch.randn(2, 3, 4)
    p = torch.nn.Parameter(torch.randn(2, 5))
    out = C._transpose01(x, p)
    assert isinstance(out, tuple) and torch.equal(out[0], x.transpose(0, 1)) and out[1].requires_grad
    out[1].sum().backward()  # autograd runs on the direct path too
    assert torch.equal(p.grad, torch.ones_like(p))
    parts = C._split_contiguous((x,), -1, [1, 3])
    assert torch.equal(parts[0][1], x[..., 1:])
    assert torch.equal(C._gather([x, x], 1, torch.device("cpu")), torch.cat([x, x], 1))
    assert torch.equal(C._scatter([x], 0, [1, 1], [torch.device("cpu")] * 2)[0][1], x[1:])


@needs_ext
def test_fast_path_defers_what_it_does_not_handle():
    """Subclasses, __torch_function__ modes and unusual argument types go the torch.ops way, not around it."""
    from torch.overrides import TorchFunctionMode

    from dpfast.ext.loader import C

    seen = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 3)
    assert C._transpose01(x.as_subclass(Logged)) is NotImplemented
    (y,) = ops.transpose01(x.as_subclass(Logged))
    assert torch.ops.dpfast.transpose01.default in seen and torch.equal(y, x.t())
    seen.clear()
    with Mode():
        assert C._transpose01(x) is NotImplemented
        ops.split_contiguous([x], 1, [1, 2])
    assert torch.ops.dpfast.split_contiguous.default in seen
    # not a list/tuple of ints, not a torch.device: left to torch.ops, which accepts or rejects them as usual
    assert C._split_contiguous([x], 1, range(1, 3)) is NotImplemented
    assert C._split_contiguous([x], True, [1, 2]) is NotImplemented
    assert C._gather([x], 0, "cpu") is NotImplemented
    assert torch.equal(ops.split_contiguous((x,), 1, range(1, 3))[0][1], x[:, 1:])


@needs_ext
def test_fast_path_is_seen_by_dispatch_modes():
    """The direct path calls the op through the dispatcher, so a TorchDispatchMode still sees it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dpfast.ext.loader import C

    seen = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 3)
    with Mode():
        (y,) = C._transpose01(x)
    assert seen == [torch.ops.dpfast.transpose01.default] and torch.equal(y, x.t())


def test_reference_errors_agree():
    for fn in (ops, ref):
        with pytest.raises(ValueError, match="sum to 4"):
            fn.split_contiguous([torch.randn(5, 2)], 0, [2, 2])


def test_empty_lists():
    assert ops.transpose01() == ()
    assert ops.split_contiguous([], 0, [1, 2]) == []
    assert ops.scatter([], 0, [1], ["cpu"]) == []


def test_build_info_keys():
    info = dpfast.build_info()
    for key in ("torch_version", "extension_loaded", "cuda_kernels_compiled", "cuda_arch_list", "ops_backend"):
        assert key in info


# ---- CUDA only --------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_ext
def test_cuda_runs_on_current_stream():
    s = torch.cuda.Stream()
    x = torch.randn(64, 128, 32, device="cuda")
    s.wait_stream(torch.cuda.current_stream())  # x is made on the current stream
    with torch.cuda.stream(s):
        out = ops.transpose01(x)[0]
    s.synchronize()
    assert torch.equal(out, x.transpose(0, 1).contiguous())


@pytest.mark.cuda
@needs_ext
def test_cuda_many_jobs_staged_path():
    xs = [torch.randn(3, 5, 7, device="cuda") for _ in range(40)]  # more jobs than travel inline
    for o, r in zip(ops.transpose01(*xs), ref.transpose01(*xs)):
        assert_bitexact(o, r)


@pytest.mark.cuda
@needs_ext
def test_cuda_cpu_scatter_and_gather_across_devices():
    n = torch.cuda.device_count()
    devs = [f"cuda:{i % n}" for i in range(3)] + ["cpu"]
    x = torch.randn(9, 4, requires_grad=True)
    parts = ops.scatter([x.cuda()], 0, [2, 3, 3, 1], devs)[0]
    assert [str(p.device) for p in parts] == devs
    back = ops.gather(parts, 0, "cpu")
    assert torch.equal(back, x.detach())
    back.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.cuda
@needs_ext
def test_cuda_graph_capture_with_many_jobs():
    """More than 16 jobs under CUDA graph capture: the pinned staging buffer would be read again at every replay
    after the host allocator handed it out again, so capture launches the jobs as kernel parameters instead."""
    xs = [torch.randn(3, 5, 7, device="cuda") for _ in range(40)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside the capture, as torch.cuda.graphs asks: the staged kernel and
        for n in (1, 8, 16, len(xs)):  # the inline ones that the capture launches
            ops.transpose01(*xs[:n])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = ops.transpose01(*xs)
    for _k in range(3):
        for x in xs:
            x.copy_(torch.randn_like(x))
        junk = [torch.full((4096,), 7, dtype=torch.uint8).pin_memory().to("cuda", non_blocking=True) for _ in range(8)]
        del junk  # churn the pinned host allocator between replays
        g.replay()
        torch.cuda.synchronize()
        for o, r in zip(outs, ref.transpose01(*xs)):
            assert_bitexact(o, r)


@pytest.mark.cuda
@needs_ext
def test_cuda_gather_from_pinned_host_chunk_is_not_a_late_read():
    """A pinned CPU chunk is copied before gather returns: writing to it afterwards must not change the result."""
    cpu = torch.arange(1 << 20, dtype=torch.float32).view(1024, 1024).pin_memory()
    expect = cpu.clone()
    gpu = torch.randn(16, 1024, device="cuda")
    torch.cuda._sleep(200_000_000)  # keep the stream busy, so an async copy would still be queued
    out = ops.gather([cpu, gpu], 0, "cuda")
    cpu.fill_(-1.0)
    torch.cuda.synchronize()
    assert torch.equal(out[:1024].cpu(), expect) and torch.equal(out[1024:], gpu)


@pytest.mark.cuda
@needs_ext
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_scatter_to_other_gpus_on_side_streams_is_ordered():
    """Chunks for other GPUs move on side streams: they must wait for the pack behind a busy source stream, and
    the packed block must not be reused (and overwritten) on the source while the copy still reads it."""
    x = torch.randn(4096, 1024, device="cuda:0")
    expect = x.cpu()
    torch.cuda._sleep(200_000_000)  # the pack queues behind this on cuda:0's current stream
    parts = ops.scatter([x], 0, [1024, 1024, 1024, 1024], ["cuda:1", "cuda:0", "cuda:1", "cpu"])[0]
    junk = [torch.full((1024, 1024), -1.0, device="cuda:0") for _ in range(8)]  # would land in a freed pack
    assert [p.device for p in parts] == [torch.device(d) for d in ("cuda:1", "cuda:0", "cuda:1", "cpu")]
    for j, p in enumerate(parts):  # no synchronize: the current streams of cuda:1 must already wait for the copies
        assert torch.equal(p.cpu(), expect[1024 * j : 1024 * (j + 1)]), j
    del junk


def test_many_dims_take_the_fallback_path(device):
    """More than six non-mergeable dims cannot be one copy job; the result must still be exact."""
    x = make((2, 3, 2, 3, 2, 3, 2, 3), torch.float32, device).permute(7, 5, 3, 1, 0, 2, 4, 6)
    for o, r in zip(ops.transpose01(x, x[:, :2]), ref.transpose01(x, x[:, :2])):
        assert_bitexact(o, r)
    for o, r in zip(ops.split_contiguous([x], 4, [1, 1])[0], ref.split_contiguous([x], 4, [1, 1])[0]):
        assert_bitexact(o, r)
    parts = ops.split_contiguous([x], 0, [1, 2])[0]
    assert_bitexact(ops.gather([parts[0], x[1:]], 0, device), x.contiguous())
