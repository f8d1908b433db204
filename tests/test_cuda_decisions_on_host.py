"""The CUDA paths' decisions and the copy kernel's index walk, run on the host (no GPU needed).

dpfast._C_hooks (csrc/testing/python_hooks.cpp) exposes the very functions the CUDA code calls -- which GPUs
scatter serves on side streams, which streams a backward node bridges, the kernel's per-unit offsets and its
per-thread walk -- so that a mistake in them fails here, not only on the GPU machine. That module is built only for
the tests (DPFAST_TEST_HOOKS=1: `make test`, `make sanitize`); where it is not (an installed wheel), this file skips.
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpfast.ext import loader

from dp_testing import assert_bitexact, random_bits

if not (loader.RECORD or {}).get("test_hooks"):
    pytest.skip(
        "dpfast._C_hooks, the C++ test hooks, is not built here: it is built with DPFAST_TEST_HOOKS=1 (make test, "
        "make sanitize); installed wheels leave it out",
        allow_module_level=True,
    )
hooks = importlib.import_module("dpfast._C_hooks")  # built: a failure to load it is an error, not a skip

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # unindexed: the current device
C0, C1, C2 = (torch.device("cuda", i) for i in range(3))


# ---- which streams the multi-device paths order against ----------------------------------------------------------


def test_unindexed_cuda_is_the_current_device_not_another_gpu():
    """'cuda' compared as is with the source's 'cuda:0' passed for another GPU: a side-stream copy into the same
    device that nothing made the caller's stream wait for."""
    assert hooks._side_stream_devices([CUDA, CUDA], C0, 0) == []
    assert hooks._side_stream_devices([CUDA, C0], C0, 0) == []
    assert hooks._side_stream_devices([CUDA, C0], C0, 1) == [C1]  # the current device is cuda:1: it is another GPU


def test_side_streams_serve_each_other_gpu_once_and_never_the_cpu():
    assert hooks._side_stream_devices([C1, CPU, C0, C1, C2, CUDA], C0, 0) == [C1, C2]
    assert hooks._side_stream_devices([CPU, CPU], C0, 0) == []


def test_no_side_stream_or_event_when_every_chunk_stays_on_the_source():
    """The [0, 0] rehearsal: nothing to fork, so scatter makes no event at all."""
    assert hooks._side_stream_devices([C0, C0], C0, 0) == []
    assert hooks._side_stream_devices([C1, C1, CPU], C1, 0) == []


def test_backward_node_bridges_the_other_gpus_it_touches():
    # SplitBackward: its gradients live where the chunks went; its own device is the first CUDA one among them
    assert hooks._node_streams([CPU, C1, C0, C1], [CPU, C1, C0, C1]) == (C1, [C0])
    assert hooks._node_streams([C0, C0], [C0, C0]) == (C0, [])  # one GPU: the engine's own sync is enough
    # GatherBackward: its own device is the output's, and it writes the chunks' devices
    assert hooks._node_streams([C0], [C0, C1, CPU, C1, C2]) == (C0, [C1, C2])
    # a node on the CPU has no stream of its own: the engine orders its CUDA outputs by their devices' streams
    assert hooks._node_streams([CPU], [C0, C1]) == (None, [])


def test_decision_hooks_reject_bad_arguments():
    with pytest.raises(TypeError):
        hooks._side_stream_devices(["cuda"], C0, 0)
    with pytest.raises(ValueError, match="out of range"):
        hooks._side_stream_devices([C0], C0, -1)
    with pytest.raises(TypeError):
        hooks._node_streams([C0])


# ---- the kernel's offsets: bit-exact against plain integer arithmetic, also past 2^32 units ----------------------


def expected_offsets(sizes, src_strides, dst_strides, u):
    s = d = 0
    for size, ss, ds in zip(reversed(sizes), reversed(src_strides), reversed(dst_strides)):
        u, i = divmod(u, size)
        s += i * ss
        d += i * ds
    return s, d


def sample_units(numel, rng, k=200):
    edges = [0, 1, numel - 1, numel - 2, numel // 2, (1 << 32) - 1, 1 << 32, (1 << 32) + 1]
    return sorted({u for u in edges if 0 <= u < numel} | {rng.randrange(numel) for _ in range(k)})


@pytest.mark.parametrize(
    "sizes",
    [
        [7],  # flat
        [3, 5, 7],  # 32-bit
        [65535, 65537],  # exactly 2^32 - 1 units: the last job that takes 32-bit index math
        [65536, 65536],  # exactly 2^32: 64-bit
        [70001, 3, 20483],  # past 2^32 units
        [1 << 33],  # a flat job past 2^32
        [2, 3, 5, 7, 11, 13],  # six dims
        [3, 1 << 31, 5],  # a single dim past 2^31
    ],
)
def test_kernel_offsets_match_integer_arithmetic(sizes):
    rng = random.Random(len(sizes))
    numel = 1
    for s in sizes:
        numel *= s
    for _ in range(3):
        src = [rng.choice([0, 1, 2, 16]) * rng.randint(1, 1 << 20) * rng.choice([1, -1]) for _ in sizes]
        dst = [rng.randint(0, 1 << 24) for _ in sizes]
        units = sample_units(numel, rng)
        got = hooks._job_offsets(sizes, src, dst, units)
        assert got == [expected_offsets(sizes, src, dst, u) for u in units]


def test_kernel_offsets_refuse_units_outside_the_job():
    with pytest.raises(IndexError):
        hooks._job_offsets([3, 4], [4, 1], [4, 1], [12])
    with pytest.raises(ValueError):
        hooks._job_offsets([3, 0], [4, 1], [4, 1], [0])


# ---- the kernel's walk: every unit moved exactly once, to its place, whatever the grid ---------------------------

GRIDS = [(1, 1), (1, 3), (2, 32), (3, 256), (7, 5), (132 * 3, 256)]
DTYPES = [torch.uint8, torch.int8, torch.float16, torch.float32, torch.float64, torch.complex128, torch.bool]


def layouts(x, rng):
    """The same values under different memory layouts and alignments."""
    yield x
    if x.dim() >= 2:
        yield x.transpose(0, 1).contiguous().transpose(0, 1)
    pad = rng.randint(1, 15)  # a contiguous view at an odd address: narrower units
    flat = torch.empty(x.numel() + pad, dtype=x.dtype)
    view = flat[pad:].view(x.shape)
    view.copy_(x)
    yield view
    if x.dim() >= 1 and x.shape[0] > 0:
        yield x[:1].expand(x.shape)  # zero strides


def replay(src, dst, grid):
    moved, planned, _jobs, _fallback = hooks._replay_cuda_copy([src], [dst], *grid)
    assert moved == planned, f"the walk moved {moved} units of {planned}: a unit skipped or moved twice"


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_walk_copies_every_layout_exactly(grid, dtype):
    rng = random.Random(str(dtype) + str(grid))
    for shape in [(5,), (3, 4), (1, 7), (2, 3, 4), (4, 1, 33), (3, 2, 1, 2, 3), (17, 9)]:
        for src in layouts(random_bits(shape, dtype, seed=len(shape)), rng):
            dst = torch.empty(shape, dtype=dtype)
            replay(src, dst, grid)
            assert_bitexact(dst, src, contiguous=False)


@pytest.mark.parametrize("grid", [(1, 1), (3, 256)])
def test_kernel_walk_writes_strided_destinations(grid):
    """Transposed and gathered-into outputs: the destination side is strided too (gather into an inner dim)."""
    x = random_bits((6, 5, 4), torch.float32, seed=1)
    out = torch.zeros(6, 9, 4)
    dst = out[:, 2:7]
    replay(x, dst, grid)
    assert torch.equal(dst, x) and not out[:, :2].any() and not out[:, 7:].any()
    y = torch.empty(5, 6, 4)
    replay(x.transpose(0, 1), y, grid)
    assert torch.equal(y, x.transpose(0, 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=7),
    dtype=st.sampled_from(DTYPES),
    blocks=st.integers(1, 9),
    threads=st.sampled_from([1, 2, 32, 33, 256]),
    perm_seed=st.integers(0, 1000),
    offset=st.integers(0, 3),
)
def test_property_kernel_walk_is_a_bijection(shape, dtype, blocks, threads, perm_seed, offset):
    rng = random.Random(perm_seed)
    perm = list(range(len(shape)))
    rng.shuffle(perm)
    base = random_bits([s + offset for s in shape], dtype, seed=perm_seed).permute(*perm)
    src = base[tuple(slice(offset, offset + shape[p]) for p in perm)]
    dst = torch.empty(src.shape, dtype=dtype)
    moved, planned, jobs, fallback = hooks._replay_cuda_copy([src], [dst], blocks, threads)
    assert moved == planned and jobs + fallback == 1
    assert_bitexact(dst, src, contiguous=False)
