"""dpfast.distributed.bucket_check's Python comm hook (what CUDA buckets, a user's own hook and the pure-Python
fallback get): what it writes into the first bucket's all-reduce. On a group of ranks it runs in
tests/test_distributed_checks.py; a GPU backward through it makes no host sync (tests/test_cuda_on_gpu.py)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpfast.distributed.bucket_check import BucketCheck, decode_table, encode_row
from dpfast.distributed.group import RankGroup


def _check(rank: int, world: int, row: list[int]) -> BucketCheck:
    group = RankGroup(None, rank, world, torch.device("cpu"))
    return BucketCheck(group, lambda: row, lambda rows: None)


def test_the_row_is_made_on_the_buckets_device_once_per_row():
    """The table with this rank's row alone lives where the bucket does (here the meta device stands in for a GPU:
    a row kept on the host would be copied into a GPU bucket in every backward, a blocking copy), and is made anew
    only for another row, dtype or device."""
    check = _check(1, 3, [0, 12345, 1])
    meta, cpu = torch.device("meta"), torch.device("cpu")
    first = check._alone((0, 12345, 1), 16, torch.float32, meta)
    assert first.device == meta and first.dtype == torch.float32 and first.shape == (3 * 6,)
    assert check._alone((0, 12345, 1), 16, torch.float32, meta) is first
    assert check._alone((0, 12346, 1), 16, torch.float32, meta) is not first
    on_cpu = check._alone((0, 12345, 1), 8, torch.bfloat16, cpu)
    k = 2 + 64 // 8
    assert on_cpu.device == cpu and on_cpu.tolist() == [0] * k + encode_row((0, 12345, 1), 8) + [0] * k


def _reading(rank, world, row):
    """A check whose verify and agreed calls are recorded, and the table its ``row`` alone makes."""
    calls: list = []
    group = RankGroup(None, rank, world, torch.device("cpu"))
    check = BucketCheck(group, lambda: row, lambda rows: calls.append(("verify", rows)), lambda: calls.append("ok"))
    return check, calls


def _summed(rows, bits=16):
    """The all-reduced table of these ranks' rows."""
    return torch.tensor([v for r in rows for v in encode_row(r, bits)], dtype=torch.float32)


def test_a_table_of_every_rank_agreeing_is_taken_without_decoding():
    """Every rank sent this rank's OK row: ``agreed()``, the outcome ``verify`` would reach, with one comparison."""
    row = [0, -(2**63) + 7, 2]
    check, calls = _reading(1, 3, row)
    check._table(4, torch.float32, torch.device("cpu"), 16)
    check._check(_summed([row] * 3), 16, check._agreeing())
    assert calls == ["ok"]


def test_a_table_that_differs_anywhere_is_decoded_for_verify():
    """Another rank's row differing in any value, or this rank's own row not OK: every row goes to ``verify``."""
    row = [0, 12345, 2]
    for other in ([0, 12346, 2], [0, 12345, 3], [2, 12345, 2]):
        check, calls = _reading(0, 2, row)
        check._table(4, torch.float32, torch.device("cpu"), 16)
        check._check(_summed([row, other]), 16, check._agreeing())
        assert calls == [("verify", [row, other])]
    failed = [2, 12345, 2]  # this rank's own status is not OK, as every other rank's
    check, calls = _reading(0, 2, failed)
    check._table(4, torch.float32, torch.device("cpu"), 16)
    assert check._agreeing() is None
    check._check(_summed([failed, failed]), 16, check._agreeing())
    assert calls == [("verify", [failed, failed])]


class _HostCopies(TorchDispatchMode):
    """Records every op that copies a host tensor into a tensor on another device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + ([out] if isinstance(out, torch.Tensor) else [])
        if any(t.device.type == "cpu" for t in tensors) and any(t.device.type != "cpu" for t in tensors):
            self.seen.append(str(func))
        return out


def test_a_backwards_table_copies_nothing_from_the_host_once_its_row_is_made():
    """Step after step with the same row, ``_table`` for a bucket off the host (meta, standing in for a GPU) makes
    no copy from the host: on a GPU each would be a blocking copy, the host waiting for the stream."""
    check = _check(0, 2, [0, 99, 1])
    meta = torch.device("meta")
    check._table(7, torch.float32, meta, 16)  # the first step makes the row
    with _HostCopies() as copies:
        for _ in range(3):
            check._table(7, torch.float32, meta, 16)
    assert copies.seen == []


def test_the_table_holds_this_ranks_row_in_its_place():
    """``_table``: the gradients' room first, then one row per rank, this rank's filled and the others zero (the
    all-reduce's sum then holds every rank's row)."""
    row = [0, -(2**63) + 7, 2]
    check = _check(1, 3, row)
    full = check._table(5, torch.float64, torch.device("cpu"), 16)
    assert full.shape == (5 + 3 * 6,)
    rows = decode_table(full[5:].tolist(), 16, 3)
    assert rows[1] == row and rows[0] == rows[2] == [0, 0, 0]
    again = check._table(5, torch.float64, torch.device("cpu"), 16)
    assert again is full and decode_table(again[5:].tolist(), 16, 3)[1] == row
