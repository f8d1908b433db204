"""Hostile but legal-looking arguments to the fused ops: each case must end in a clean error or a right result.

Every case runs in a subprocess, so a crash (a heap overflow, an index past a vector) fails that test instead of
killing the test run. The same cases run under AddressSanitizer/UBSan in `make sanitize`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import dpfast
from dpfast.ext import loader

needs_extension = pytest.mark.skipif(not dpfast.build_info()["extension_loaded"], reason="dpfast._C not built")

PRELUDE = """
import torch, dpfast
from dpfast import ops, reference
from torch.utils._python_dispatch import TorchDispatchMode

def agree(op, *args, exc=ValueError, match=""):
    # the same exception type and message from dpfast.ops, the torch.ops path and the reference
    def outcome(fn):
        try:
            fn()
        except Exception as e:
            return type(e), str(e)
        return None
    schema_args = (list(args),) if op == "transpose01" else args
    got = {"ops": outcome(lambda: getattr(ops, op)(*args)),
           "reference": outcome(lambda: getattr(reference, op)(*args))}
    if dpfast.build_info()["extension_loaded"]:  # (the dispatcher's path: the extension's alone)
        got["torch.ops"] = outcome(lambda: getattr(torch.ops.dpfast, op)(*schema_args))
    first = got["reference"]
    assert first is not None and first[0] is exc and match in first[1], first
    assert all(g == first for g in got.values()), got

def expect(exc, match, fn):
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{type(e).__name__}: {e}"
    else:
        raise AssertionError(f"no {exc.__name__} raised")

class Truncating(TorchDispatchMode):
    # returns one tensor fewer than a dpfast op should: callers must check the count before indexing
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "dpfast" and isinstance(out, (list, tuple)):
            return list(out)[:-1]
        return out

huge = torch.zeros(1, dtype=torch.uint8).expand(2**62)        # zero strides: 2**62 elements, one byte of memory
huge5 = torch.zeros(1, dtype=torch.uint8).expand(2**62 + 5)
"""

CASES = {
    "gather_sizes_sum_past_int64": """
        agree("gather", [huge, huge, huge, huge5], 0, torch.device("cpu"), match="sum past 2**63 - 1")
        agree("gather", [huge5, huge5], -1, torch.device("cpu"), match="sum past 2**63 - 1")
    """,
    "gather_output_bytes_past_int64": """
        rows = torch.zeros(1, 1, dtype=torch.float64).expand(2**60, 2)  # 2**61 elements each
        agree("gather", [rows] * 4, 0, torch.device("cpu"), match="more than 2**63 - 1 bytes")
    """,
    "split_sizes_sum_past_int64": """
        x = torch.zeros(3)
        agree("split_contiguous", [x], 0, [2**63 - 1, 2**63 - 1, 5], match="sum past 2**63 - 1")
        agree("scatter", [x], 0, [2**63 - 1, 2**63 - 1, 5], [torch.device("cpu")] * 3, match="sum past 2**63 - 1")
        agree("split_contiguous", [huge5], 0, [2**62, 2**62, 5, -0], match="sum past 2**63 - 1")
    """,
    "split_of_a_huge_zero_stride_view": """
        for path in (ops, reference):  # the allocator refuses the 2**62-byte chunk before anything is copied
            expect(RuntimeError, "allocate", lambda: path.split_contiguous([huge5], 0, [2**62 + 3, 2]))
    """,
    "dispatch_mode_returns_too_few_tensors": """
        x = torch.randn(4, 3)
        for grad in (False, True):
            x.requires_grad_(grad)
            with Truncating():
                expect(RuntimeError, "were expected", lambda: ops.split_contiguous([x], 0, [2, 2]))
                expect(RuntimeError, "were expected", lambda: ops.scatter([x], 0, [2, 2], ["cpu", "cpu"]))
                expect(RuntimeError, "were expected", lambda: ops.transpose01(x, x))
                expect(RuntimeError, "were expected", lambda: torch.ops.dpfast.split_contiguous([x], 0, [2, 2]))
    """,
    "dispatch_mode_in_backward_and_forward_ad": """
        import torch.autograd.forward_ad as fwAD
        x = torch.randn(4, 3, requires_grad=True)
        parts = ops.split_contiguous([x], 0, [2, 2])[0]
        loss = parts[0].sum() + parts[1].sum()
        y = torch.randn(4, 3, requires_grad=True)
        g = ops.gather([y[:2], y[2:]], 0, "cpu")
        with Truncating():
            expect(RuntimeError, "were expected", lambda: g.sum().backward())  # GatherBackward scatters
        with fwAD.dual_level():
            dual = fwAD.make_dual(torch.randn(4, 3), torch.randn(4, 3))
            with Truncating():
                expect(RuntimeError, "were expected", lambda: ops.split_contiguous([dual], 0, [2, 2]))
        loss.backward()
        assert torch.equal(x.grad, torch.ones(4, 3))
    """,
    "meta_and_cpu_in_one_call": """
        x, m = torch.arange(6.0).reshape(2, 3), torch.empty(2, 3, device="meta")
        for path in (ops, reference):
            expect(ValueError, "move all tensors to one device", lambda: path.transpose01(x, m))
            expect(ValueError, "move all tensors to one device", lambda: path.split_contiguous([x, m], 0, [1, 1]))
            expect(NotImplementedError, "meta tensor", lambda: path.gather([x, m], 0, "cpu"))
            expect(NotImplementedError, "meta tensor", lambda: path.scatter([m], 0, [1, 1], ["cpu", "meta"]))
        assert ops.gather([x, m], 0, "meta").device.type == "meta"  # to meta is fine: no data is made up
    """,
    "scatter_backward_to_cpu_and_meta": """
        x = torch.randn(4, 3, requires_grad=True)
        a, b = ops.scatter([x], 0, [2, 2], ["cpu", "meta"])[0]
        expect(NotImplementedError, "meta tensor", lambda: torch.autograd.grad([a.sum(), b.sum()], [x]))
    """,
    "data_parallel_module_returning_meta": """
        class M(torch.nn.Module):
            def forward(self, x):
                return torch.empty(x.shape, device="meta")
        dp = dpfast.DataParallel(M(), ["cpu"] * 2)
        expect(NotImplementedError, "meta tensor", lambda: dp(torch.randn(4, 3)))
    """,
}


# The private CPython entry points (csrc/python_*.cpp, csrc/testing/) with arguments whose Python hooks run while
# the extension reads them: an item's __index__ that empties the list it sits in (every item after it is freed), and
# objects whose __class__ claims to be a Tensor (isinstance believes it; the memory is no Tensor). Each call must
# give what the same call with a plain copy of the arguments gives, or a TypeError. PYTHONMALLOC=malloc hands every
# freed Python object back to the C allocator, so a read of one fails here and AddressSanitizer sees it in
# `make sanitize`.
ENTRY_POINT_PRELUDE = """
import torch, dpfast
from dpfast.ext.loader import C, RECORD
if (RECORD or {}).get("test_hooks"):
    import dpfast._C_hooks as hooks

def emptied_by_a_collection(call, xs, *rest):
    # call(xs, *rest), with a collection at the call's own first GC-tracked allocation (Python 3.11 collects
    # there) whose callback empties xs, as a finalizer could: what the call borrowed from xs must be held by then
    import gc
    def empty(phase, info):
        if phase == "start":
            xs.clear()
    packed = (xs, *rest)  # made before the threshold drops: the call itself allocates nothing before the entry point
    gc.collect()
    gc.callbacks.append(empty)
    gc.set_threshold(1)
    try:
        return call(*packed)
    finally:
        gc.set_threshold(700)
        gc.callbacks.remove(empty)

class Emptying:
    # an int whose __index__ empties the lists it names first: the extension must hold its own references
    def __init__(self, value, *lists):
        self.value, self.lists = value, lists
    def __index__(self):
        for items in self.lists:
            items.clear()
        return self.value

def hostile(values):
    # values[0] as an Emptying of this very list, then fresh int objects (above 256: not Python's cached ints)
    items = []
    items.append(Emptying(values[0], items))
    items.extend(int(str(v)) for v in values[1:])
    return items

class NotATensor:
    @property
    def __class__(self):
        return torch.Tensor

def same_as_plain(fn, *plain_args, hostile_args):
    expected = fn(*plain_args)
    got = fn(*hostile_args)
    assert got == expected, (got, expected)

def type_error(fn, *args):
    try:
        fn(*args)
    except TypeError as e:
        assert "must be a Tensor" in str(e) or "must hold tensors" in str(e), e
    else:
        raise AssertionError("no TypeError")
"""

ENTRY_POINT_CASES = {
    "job_offsets_units_emptied_by_an_item": """
        sizes, strides = [2**20, 2**20], [2**20, 1]
        units = [2**33 + 7 * i for i in range(64)]
        same_as_plain(hooks._job_offsets, sizes, strides, strides, units,
                      hostile_args=(sizes, strides, strides, hostile(units)))
    """,
    "job_offsets_sizes_emptied_by_an_item": """
        sizes, strides = [300, 400, 500], [200000, 500, 1]
        same_as_plain(hooks._job_offsets, sizes, strides, strides, [1000],
                      hostile_args=(hostile(sizes), strides, hostile(strides), [1000]))
    """,
    "balanced_bounds_mult_and_targets_emptied_by_an_item": """
        prefix = torch.zeros(1001, 2, dtype=torch.long)
        prefix[:, 1] = torch.arange(1001) * 3
        mult = [1000 + i for i in range(64)]
        targets = [min(1000, 300 + 10 * i) for i in range(64)]
        args = (0, 0, 0, 3000 * 2000)
        same_as_plain(C._balanced_bounds, prefix, mult, targets, *args,
                      hostile_args=(prefix, hostile(mult), targets, *args))
        same_as_plain(C._balanced_bounds, prefix, mult, targets, *args,
                      hostile_args=(prefix, mult, hostile(targets), *args))
    """,
    "replay_cuda_copy_lists_emptied_by_the_grid_size": """
        def pairs():
            srcs = [torch.arange(300.0 + i) for i in range(64)]
            return srcs, [torch.empty_like(s) for s in srcs]
        srcs, dsts = pairs()
        expected = hooks._replay_cuda_copy(srcs, dsts, 2, 32)
        srcs, dsts = pairs()
        got = hooks._replay_cuda_copy(srcs, dsts, Emptying(2, srcs, dsts), 32)
        assert got == expected, (got, expected)
    """,
    "replay_cuda_copy_object_claiming_to_be_a_tensor": """
        x = torch.arange(4.0)
        type_error(hooks._replay_cuda_copy, [NotATensor()], [x], 1, 32)
        type_error(hooks._replay_cuda_copy, [x], [NotATensor()], 1, 32)
    """,
    "cost_entry_points_object_claiming_to_be_a_tensor": """
        type_error(C._exact_prefix, NotATensor())
        type_error(C._balanced_bounds, NotATensor(), [1], [1], 0, 0, 0, 1)
    """,
    # _gather_many, _narrow_many, _leaf_facts and _batch_size read only exact ints and exact Tensors (no Python code
    # runs while they read): anything else is declined (NotImplemented / None), and Python takes its own path
    "many_leaves_entry_points_decline_hostile_items": """
        cpu, xs = torch.device("cpu"), [torch.randn(300, 2) for _ in range(3)]
        outs, follows, done = C._gather_many([xs, xs], [0, 0, 0], cpu, [300, 300])
        assert done and all(torch.equal(o, torch.cat([x, x])) for o, x in zip(outs, xs))
        assert C._gather_many([xs, xs], hostile([0, 0, 0]), cpu, [300, 300]) is NotImplemented
        assert C._gather_many([xs, xs], [0, 0, 0], cpu, hostile([300, 300])) is NotImplemented
        outs, follows, done = C._gather_many([xs, [NotATensor()] * 3], [0, 0, 0], cpu, [300, 300])
        assert outs == [None] * 3 and not done
        cut = C._narrow_many(xs, [0, -1, 0], 100, 50)
        assert [c.shape[0] for c in cut] == [50, 300, 50] and cut[1] is xs[1]
        assert C._narrow_many(xs, hostile([0, 0, 0]), 100, 50) is NotImplemented
        assert C._narrow_many(xs, [0, 0, 0], hostile([100])[0], 50) is NotImplemented
        assert C._narrow_many([NotATensor()] * 3, [0, 0, 0], 100, 50) is NotImplemented
        assert C._narrow_many(xs, [0, 0, 0], 2**63 - 1, 2**63 - 1) is NotImplemented
        assert C._narrow_many(xs, [0, 0, 0], 2**64, 1) is NotImplemented
        codes, others = C._leaf_facts(xs + [NotATensor(), None, 3])
        assert len(codes) == 24 and codes[:12] == codes[:4] * 3 and codes[12:] == bytes(12) and others == [3, 4, 5]
        assert C._leaf_facts(hostile([1])) == (bytes(4), [0])  # (an int, whatever it does: not a tensor)
        assert C._leaf_facts(NotATensor()) is NotImplemented
        assert C._batch_size(xs, [0, 2], [0, 1]) is None  # 300 along 0, 2 along 1: they differ
        assert C._batch_size(xs, [0, 1, 2], [0, 0, 0]) == 300
        assert C._batch_size(xs, hostile([0, 1]), [0, 0]) is NotImplemented
        assert C._batch_size(xs, [0, 1], hostile([0, 0])) is NotImplemented
        assert C._batch_size(xs, [0, 3], [0, 0]) is NotImplemented  # a position past the leaves
        assert C._batch_size(xs, [0, -1], [0, 0]) is NotImplemented
        assert C._batch_size(xs, [0, 1], [0, 2]) is NotImplemented  # an axis the tensor does not have
        assert C._batch_size(xs, [0, 1], [0]) is NotImplemented
        assert C._batch_size([NotATensor()], [0], [0]) is NotImplemented
        assert C._batch_size(xs, [2**64], [0]) is NotImplemented
        # columns of another length than dims: declined before anything is sized by their counts
        assert C._gather_many([[]] * 100_000, [0] * 10_000, cpu, [1]) is NotImplemented
    """,
    # _leaf_facts and _batch_size borrow the list's items: every one is read before the first allocation
    "leaf_facts_list_emptied_by_a_collection": """
        xs = [torch.randn(300, 2) for _ in range(64)]
        codes, others = emptied_by_a_collection(C._leaf_facts, xs)
        assert len(codes) == 256 and codes == codes[:4] * 64 and others == [] and not xs
        xs = [torch.randn(300, 2) for _ in range(64)]
        assert emptied_by_a_collection(C._batch_size, xs, list(range(64)), [0] * 64) == 300  # (allocates nothing)
    """,
    # _narrow_many borrows the list's items too: every Tensor is taken before the first allocation
    "narrow_many_list_emptied_by_a_collection": """
        xs = [torch.randn(300, 2) for _ in range(64)]
        got = emptied_by_a_collection(C._narrow_many, xs, [0] * 64, 10, 20)
        assert len(got) == 64 and all(t.shape == (20, 2) for t in got) and not xs, got
    """,
    # _restore_dicts clears dicts, which can run a value's __del__: here one that empties both lists and the saved
    # dicts, and drops the last other reference to every dict, before the later ones are restored
    "restore_dicts_finalizer_empties_everything": """
        class Wiper:
            def __init__(self, *targets):
                self.targets = targets
            def __del__(self):
                for t in self.targets:
                    t.clear()
        lives = [{"a": 1}] + [{"k": int(str(300 + i))} for i in range(63)]
        saved = [dict(d, b=2) for d in lives]
        lives[0]["w"] = Wiper(lives, saved, *saved[1:])
        keep = lives[0]
        assert C._restore_dicts(lives, saved) is None
        assert keep == {"a": 1, "b": 2} and lives == [] and saved == [], (keep, lives, saved)
    """,
    # _same_dicts reads dicts, tuples and lists it borrows, and runs no Python code meanwhile: nothing can change them
    "same_dicts_read_borrowed": """
        dicts = [{"k": int(str(300 + i)), "j": object()} for i in range(64)]
        keys = [tuple(d) for d in dicts]
        values = [tuple(d.values()) for d in dicts]
        assert C._same_dicts(dicts, keys, values) is True
        assert emptied_by_a_collection(C._same_dicts, dicts, keys, values) is True
        assert C._same_dicts([{}], [()], [(1,)]) is NotImplemented
        assert C._same_dicts([NotATensor()], [()], [()]) is NotImplemented
    """,
}


def _run_case(code: str, tmp_path, **env_overrides) -> None:
    env = dict(os.environ, PYTHONFAULTHANDLER="1", **env_overrides)
    # from another folder: `python -c` puts its working directory first on sys.path, and dpfast must come from
    # where the test session's own dpfast comes from (an installed or sanitized build, not the source tree)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [os.path.dirname(os.path.dirname(dpfast.__file__)), env.get("PYTHONPATH", "")] if p
    )
    proc = subprocess.run(
        [sys.executable, "-c", code + "\nprint('OK')\n"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        f"exit code {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_ends_cleanly(case, tmp_path):
    if "Truncating" in CASES[case] and not dpfast.build_info()["extension_loaded"]:
        pytest.skip("a dispatch mode truncating torch.ops.dpfast's results: the dispatcher's path is the extension's")
    _run_case(PRELUDE + textwrap.dedent(CASES[case]), tmp_path)


@needs_extension
@pytest.mark.parametrize("case", sorted(ENTRY_POINT_CASES))
def test_entry_point_holds_its_arguments(case, tmp_path):
    code = textwrap.dedent(ENTRY_POINT_CASES[case])
    if "hooks." in code and not (loader.RECORD or {}).get("test_hooks"):
        pytest.skip("dpfast._C_hooks, the C++ test hooks, is not built (DPFAST_TEST_HOOKS=1, as make test sets it)")
    _run_case(ENTRY_POINT_PRELUDE + code, tmp_path, PYTHONMALLOC="malloc")


@needs_extension
def test_entry_point_fuzzer_finds_nothing(tmp_path):
    """A short run of `make sanitize`'s fuzzer of the entry points' argument parsing (tests/fuzz_entry_points.py)."""
    code = f"import sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\nimport fuzz_entry_points\n"
    _run_case(code + "assert fuzz_entry_points.main(['--rounds', '3000']) == 0", tmp_path, PYTHONMALLOC="malloc")
