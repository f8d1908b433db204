"""The CUDA paths on a GPU: unindexed devices, job counts around the inline limits, jobs past 2^32 units,
misaligned inputs, graph capture, pinned memory, hidden host syncs and backward under user streams.

Most tests are marked ``cuda`` (skipped without a GPU; ``benchmarks/gpu_check.sh`` runs them). Work that must be
ordered is queued behind ``torch.cuda._sleep`` so that a missing wait shows up as a wrong value, not as luck.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import dpfast
from dpfast import ops
from dpfast import reference as ref

from dp_testing import assert_bitexact, random_bits

needs_ext = pytest.mark.skipif(not dpfast.build_info()["extension_loaded"], reason="dpfast._C not built")
cuda = pytest.mark.cuda
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
# Under compute-sanitizer (gpu_check.sh) torch's caching allocator is off: no graphs, no allocation counts.
caching = pytest.mark.skipif(
    os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"), reason="needs the caching allocator"
)
BUSY = 100_000_000  # torch.cuda._sleep cycles: tens of milliseconds of a busy stream


def make(shape, dtype, device="cuda", seed=0):
    """Random bits (dp_testing.random_bits), on the GPU unless told otherwise."""
    return random_bits(shape, dtype, device, seed)


def current():
    return torch.device("cuda", torch.cuda.current_device())


# ---- unindexed devices ------------------------------------------------------------------------------------------


@cuda
@needs_ext
@caching
def test_scatter_to_unindexed_cuda_makes_no_side_copy_and_is_ordered():
    """'cuda' is the source device itself: the packed chunks are the result (a side-stream copy into the same
    device, unordered with the caller's stream, was made before), readable at once on the current stream."""
    x = torch.randn(1 << 22, 8, device="cuda")
    expect = x.clone()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda._sleep(BUSY)  # the pack queues behind this
    parts = torch.ops.dpfast.scatter.default([x], 0, [1 << 21, 1 << 21], [torch.device("cuda")] * 2)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == 2  # the two chunks, nothing else
    assert [p.device for p in parts] == [current()] * 2
    assert torch.equal(torch.cat(parts), expect)  # no synchronize: ordered on the current stream


@cuda
@needs_ext
def test_unindexed_cuda_through_torch_ops():
    dev = current()
    x = make((6, 5, 3), torch.float32)
    cpu = make((6, 5, 3), torch.float64, "cpu", seed=1)
    for t in (x, cpu):
        parts = torch.ops.dpfast.scatter.default([t], 1, [2, 3], [torch.device("cuda"), torch.device("cpu")])
        assert [p.device for p in parts] == [dev, torch.device("cpu")]
        for o, e in zip(parts, ref.scatter([t], 1, [2, 3], [dev, "cpu"])[0]):
            assert_bitexact(o, e)
        out = torch.ops.dpfast.gather.default(parts, 1, torch.device("cuda"))
        assert_bitexact(out, t.contiguous().to(dev))


# ---- job counts, staging, huge jobs, alignment, dtypes ----------------------------------------------------------


@cuda
@needs_ext
@pytest.mark.parametrize("n", [1, 4, 5, 16, 17, 23, 24, 40])
def test_job_counts_around_the_inline_limits(n):
    """Few jobs, the most that travel as kernel parameters, and staged ones: each count is one launch."""
    xs = [make((k % 3 + 2, 5 + k % 4, 7), (torch.float32, torch.int8, torch.float16)[k % 3], seed=k) for k in range(n)]
    for o, e in zip(ops.transpose01(*xs), ref.transpose01(*xs)):
        assert_bitexact(o, e)
    x = make((3, n, 5), torch.float64).transpose(0, 2)
    for o, e in zip(ops.split_contiguous([x], 1, [1] * n)[0], ref.split_contiguous([x], 1, [1] * n)[0]):
        assert_bitexact(o, e)


@cuda
@needs_ext
def test_staged_job_tables_survive_repeated_calls_behind_a_busy_stream():
    """More jobs than travel inline are staged through pinned memory: one call's block must not be handed to the
    next call before the copy to the GPU has read it (each round has other shapes, so a reused table is wrong)."""
    rounds = []
    for r in range(6):
        xs = [make((2 + (k + r) % 3, 3 + k % 5, 4), torch.float32, seed=100 * r + k) for k in range(40)]
        torch.cuda._sleep(BUSY // 4)
        rounds.append((xs, ops.transpose01(*xs)))
    torch.cuda.synchronize()
    for xs, outs in rounds:
        for o, e in zip(outs, ref.transpose01(*xs)):
            assert_bitexact(o, e)


@cuda
@needs_ext
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32, torch.complex128])
def test_large_copies_match_reference(dtype):
    """Many more units than threads: every thread runs full groups of loads and a tail, in every unit width."""
    x = make((3, 200_003, 5), dtype).transpose(0, 1)  # odd innermost runs: units of one element
    y = make((400_000, 8), dtype, seed=1)  # contiguous: 16-byte units where the dtype allows
    for o, e in zip(ops.transpose01(x, y), ref.transpose01(x, y)):
        assert_bitexact(o, e)
    for t, dim, sizes in ((x, 0, [70_001, 130_002]), (y, 0, [1, 399_998, 1]), (y, 1, [3, 5])):
        for o, e in zip(ops.split_contiguous([t], dim, sizes)[0], ref.split_contiguous([t], dim, sizes)[0]):
            assert_bitexact(o, e)
        chunks = ref.split_contiguous([t], dim, sizes)[0]
        assert_bitexact(ops.gather(chunks, dim, "cuda"), t.contiguous())


@cuda
@needs_ext
@pytest.mark.slow
def test_job_past_2_32_units_with_index_math():
    """21 * n one-byte units in a two-dim job (a zero-stride input keeps it cheap): 64-bit index math."""
    n = (1 << 32) // 21 + 7
    base = make((3, 1, 7), torch.int8)
    out = ops.transpose01(base.expand(3, n, 7))[0]
    assert out.shape == (n, 3, 7) and out.is_contiguous()
    assert torch.equal(out, base.transpose(0, 1).expand(n, 3, 7))
    del out


@cuda
@needs_ext
@pytest.mark.slow
def test_flat_job_past_2_32_units():
    n = (1 << 32) + 77
    x = torch.tensor([5], dtype=torch.int8, device="cuda").expand(n)
    a, b = ops.split_contiguous([x], 0, [n - 3, 3])[0]
    assert a.shape == (n - 3,) and torch.equal(a, x[: n - 3]) and torch.equal(b, x[n - 3 :])
    del a, b


@cuda
@needs_ext
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32, torch.float64])
def test_misaligned_contiguous_inputs(dtype):
    """Contiguous views at addresses that are not 16-byte aligned take narrower units; every op stays exact."""
    width = torch.empty((), dtype=dtype).element_size()
    for pad in range(1, max(2, 16 // width)):
        x = make((pad + 6 * 10 * 12,), dtype, seed=pad)[pad:].view(6, 10, 12)
        assert x.is_contiguous()
        assert_bitexact(ops.transpose01(x)[0], ref.transpose01(x)[0])
        for o, e in zip(ops.split_contiguous([x], 1, [3, 7])[0], ref.split_contiguous([x], 1, [3, 7])[0]):
            assert_bitexact(o, e)
        for dim in (0, 2):
            chunks = [x.narrow(dim, 0, 1), x.narrow(dim, 1, 5)]
            assert_bitexact(ops.gather(chunks, dim, "cuda"), ref.gather(chunks, dim, "cuda"))
        for o, e in zip(ops.scatter([x], 2, [5, 7], ["cuda"] * 2)[0], ref.scatter([x], 2, [5, 7], ["cuda"] * 2)[0]):
            assert_bitexact(o, e)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.complex128, torch.int8])
def test_every_op_moves_complex128_and_int8_exactly(device, dtype):
    x = make((5, 6, 3), dtype, device)
    y = make((3, 6, 5), dtype, device, seed=1).transpose(0, 2)  # non-contiguous
    for o, e in zip(ops.transpose01(x, y), ref.transpose01(x, y)):
        assert_bitexact(o, e)
    got, want = ops.split_contiguous([x, y], 1, [2, 0, 4]), ref.split_contiguous([x, y], 1, [2, 0, 4])
    for row, erow in zip(got, want):
        for o, e in zip(row, erow):
            assert_bitexact(o, e)
    parts = ops.scatter([x, y], -2, [4, 2], [device] * 2)
    for row, erow in zip(parts, ref.scatter([x, y], -2, [4, 2], [device] * 2)):
        for o, e in zip(row, erow):
            assert_bitexact(o, e)
    assert_bitexact(ops.gather(parts[1], 1, device), y.contiguous())


# ---- graph capture ----------------------------------------------------------------------------------------------


@cuda
@needs_ext
@caching
def test_graph_capture_of_split_gather_and_scatter():
    dev = current()
    x = make((33, 64, 5), torch.float32).transpose(0, 1)  # non-contiguous
    chunks = [make((k + 1, 33, 5), torch.float32, seed=k) for k in range(3)]

    def run():
        return (
            ops.split_contiguous([x], 1, [10, 23]),
            ops.gather(chunks, 0, dev),
            torch.ops.dpfast.scatter.default([x], 0, [11, 53], [dev, torch.device("cuda")]),
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream, with the very calls (and kernels) that are captured
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        split, joined, scattered = run()
    for r in range(3):
        x.copy_(make(x.shape, torch.float32, seed=10 + r))
        for k, c in enumerate(chunks):
            c.copy_(make(c.shape, torch.float32, seed=20 + 3 * r + k))
        g.replay()
        torch.cuda.synchronize()
        for o, e in zip(split[0], ref.split_contiguous([x], 1, [10, 23])[0]):
            assert_bitexact(o, e)
        assert_bitexact(joined, ref.gather(chunks, 0, dev))
        for o, e in zip(scattered, ref.scatter([x], 0, [11, 53], [dev, dev])[0]):
            assert_bitexact(o, e)


# ---- pinned memory and host syncs -------------------------------------------------------------------------------


@cuda
@needs_ext
def test_gather_from_mixed_pinned_and_pageable_host_chunks():
    """Host chunks are read before gather returns, pinned or not: writing to them afterwards changes nothing."""
    pinned = torch.randn(512, 1024).pin_memory()
    pageable = torch.randn(256, 1024)
    gpu = torch.randn(128, 1024, device="cuda")
    expect = torch.cat([pinned, pageable, gpu.cpu(), pinned])
    torch.cuda._sleep(BUSY)
    out = ops.gather([pinned, pageable, gpu, pinned], 0, "cuda")
    pinned.fill_(-1.0)
    pageable.fill_(-2.0)
    assert torch.equal(out.cpu(), expect)


def _sleep_cycles(seconds: float) -> int:
    """torch.cuda._sleep cycles that keep the stream busy for about `seconds`."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(BUSY)
    torch.cuda.synchronize()
    return int(BUSY * seconds / max(time.perf_counter() - t, 1e-4))


@cuda
@needs_ext
def test_scatter_from_pinned_memory_returns_before_the_copy():
    """Chunks of a pinned source are packed into pinned memory, so their copy to the GPU is asynchronous; packed
    into pageable memory it waited for the busy stream."""
    x = torch.randn(8192, 2048).pin_memory()
    expect = x.clone()
    dev = current()
    ops.scatter([x], 0, [4096, 4096], [dev, dev])  # warm the pinned host pool: no cudaHostAlloc when timed
    cycles = _sleep_cycles(0.5)
    torch.cuda._sleep(cycles)
    t = time.perf_counter()
    parts = ops.scatter([x], 0, [4096, 4096], [dev, dev])[0]
    host_s = time.perf_counter() - t
    x.fill_(-1.0)  # the chunks were packed before scatter returned
    assert host_s < 0.25, f"scatter from pinned memory took {host_s:.3f} s behind a 0.5 s busy stream"
    assert torch.equal(torch.cat([p.cpu() for p in parts]), expect)


@cuda
@needs_ext
def test_hot_paths_make_no_host_sync():
    dev = current()
    h, c = torch.randn(2, 64, 128, device=dev), torch.randn(2, 64, 128, device=dev)
    xs = [torch.randn(3, 5, 7, device=dev) for _ in range(40)]
    x = torch.randn(64, 33, device=dev, requires_grad=True)
    pinned = torch.randn(64, 33).pin_memory()

    def hot():
        ops.transpose01(h, c)
        ops.transpose01(*xs)  # staged through pinned memory
        ops.split_contiguous([x.detach()], 0, [20, 44])
        torch.ops.dpfast.scatter.default([x.detach()], 1, [3, 30], [torch.device("cuda")] * 2)
        ops.scatter([pinned], 0, [32, 32], [dev, dev])
        parts = ops.scatter([x], 0, [20, 44], [dev, dev])[0]
        ops.gather(parts, 0, dev).sum().backward()

    hot()  # first calls: lazy initialization may synchronize
    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        hot()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    torch.cuda.synchronize()


# ---- backward under user streams --------------------------------------------------------------------------------


class SlowGrad(torch.autograd.Function):
    """Identity whose backward keeps its stream busy before it writes the gradient (times two): whoever reads that
    gradient without waiting for the stream reads it too early."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(BUSY)
        return g * 2


def expected_grad(x, sizes):
    return torch.cat([torch.full((s, *x.shape[1:]), 2.0 * (j + 1)) for j, s in enumerate(sizes)]).to(x.device)


@cuda
@needs_ext
@pytest.mark.parametrize("source", ["cpu", "cuda"])
def test_backward_under_a_user_stream(source):
    dev = current()
    x = torch.randn(4096, 256, device=source, requires_grad=True)
    sizes = [1024, 3072]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # forward, backward and the check all on the user's stream, as torch asks
        parts = ops.scatter([x], 0, sizes, [dev, dev])[0]
        ys = [SlowGrad.apply(p) * (j + 1) for j, p in enumerate(parts)]
        ops.gather(ys, 0, dev).sum().backward()
        assert torch.equal(x.grad, expected_grad(x, sizes))


@cuda
@needs_ext
@two_gpus
@pytest.mark.parametrize("source", ["cpu", "cuda:0"])
def test_backward_with_replicas_on_user_streams_of_two_gpus(source):
    """Each replica runs (and so backpropagates) on a user stream of its GPU. From the CPU, ScatterBackward reads
    cuda:1's gradient on that device's current stream: it must wait for the replica's stream. From cuda:0,
    GatherBackward copies the gradient to cuda:1 on a side stream behind cuda:1's busy current stream: the
    replica's backward must wait for that copy."""
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    x = torch.randn(8192, 1024, device=source, requires_grad=True)
    sizes = [4096, 4096]
    streams = [torch.cuda.Stream(device=d) for d in devs]
    parts = ops.scatter([x], 0, sizes, devs)[0]
    ys = []
    for j, (p, st) in enumerate(zip(parts, streams)):
        st.wait_stream(torch.cuda.current_stream(devs[j]))
        with torch.cuda.stream(st):
            ys.append(SlowGrad.apply(p) * (j + 1))
        torch.cuda.current_stream(devs[j]).wait_stream(st)  # the gather below reads y on the current stream
    out = ops.gather(ys, 0, source)
    with torch.cuda.device(devs[1]):
        torch.cuda._sleep(BUSY)  # cuda:1's current stream is busy when backward copies the gradient there
    out.sum().backward()
    assert torch.equal(x.grad, expected_grad(x, sizes))
