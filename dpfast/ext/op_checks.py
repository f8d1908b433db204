"""Argument handling of the fused ops, shared by :mod:`dpfast.reference`, the fake kernels and the Python side of
:mod:`dpfast.ops`, so that every path raises the same exception type with the same message as the C++ kernels
(``csrc/checks.h``, ``csrc/gather.h``; keep the texts in step).

Conversions (``as_dim``, ``as_sizes``, ``as_device``) turn what a user may pass (ints, numpy ints, ``"cuda:1"``)
into what the ops' schemas take, and refuse the rest with a ``TypeError`` naming the argument. The checks use
``torch._check_value``/``torch._check_index``, which take symbolic sizes under ``torch.compile`` as well.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor

DeviceLike = Union[int, str, torch.device]  # what every device argument accepts (defined once, here)
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

_DEVICE_CACHE: dict = {}
_CPU = torch.device("cpu")


def as_device(d: DeviceLike) -> torch.device:
    """``0`` -> ``cuda:0``; strings and devices as torch reads them; a bare ``"cuda"`` -> the current CUDA device."""
    # the common case, already normal (compared with ==: reading torch.device.type builds a string)
    if type(d) is torch.device and (d.index is not None or d == _CPU):
        return d
    if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
        raise TypeError(f"expected a device (int, str or torch.device), got {type(d).__name__} {d!r}")
    key = (type(d), d)
    dev = _DEVICE_CACHE.get(key)
    if dev is None:
        dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        if dev.type == "cuda" and dev.index is None:
            # "cuda" means the current device, which can change: never cached
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else dev
        if len(_DEVICE_CACHE) < 256:  # parsing a device string is slow; calls repeat the same few
            _DEVICE_CACHE[key] = dev
    return dev


def _index(value: Any, op: str, what: str, kind: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{op}: {what} is the bool {value!r}; {kind}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {what} is {type(value).__name__} {value!r}; {kind}") from None


def as_dim(op: str, dim: Any) -> int:
    """An int dim (numpy ints and 0-dim int tensors too); bools, floats and strings are a TypeError."""
    d = dim if type(dim) is int else _index(dim, op, "dim", "dim must be an int")
    if not INT64_MIN <= d <= INT64_MAX:
        raise IndexError(f"{op}: dim {d} is out of range (it does not fit in 64 bits)")
    return d


def as_sizes(op: str, sizes: Any) -> list[int]:
    """A list of int chunk sizes from any iterable of ints (a list, a tuple, a range, numpy ints)."""
    if isinstance(sizes, (str, bytes, Tensor)) or not hasattr(sizes, "__iter__"):
        raise TypeError(f"{op}: sizes is {type(sizes).__name__} {sizes!r}; give a list of ints, one per chunk")
    out = [
        s if type(s) is int else _index(s, op, f"sizes[{j}]", "chunk sizes must be ints") for j, s in enumerate(sizes)
    ]
    for j, s in enumerate(out):
        if not INT64_MIN <= s <= INT64_MAX:
            raise ValueError(f"{op}: sizes[{j}] is {s}, which does not fit in 64 bits; chunk sizes are 64-bit ints")
    return out


def check_tensors(op: str, what: str, xs: Sequence[Any]) -> None:
    for i, x in enumerate(xs):
        if not isinstance(x, Tensor):
            raise TypeError(f"{op}: {what}[{i}] is {type(x).__name__}, not a Tensor")


def check_same_device(op: str, xs: Sequence[Tensor]) -> None:
    for i in range(1, len(xs)):
        if xs[i].device != xs[0].device:
            raise ValueError(
                f"{op}: tensors[{i}] is on {xs[i].device} but tensors[0] is on {xs[0].device}; move all tensors to "
                "one device"
            )


def wrap_dim(op: str, what: str, i: int, x: Tensor, dim: int) -> int:
    n = x.dim()
    torch._check_value(n > 0, lambda: f"{op}: {what}[{i}] is 0-dim; it has no dim {dim} to split or join")
    torch._check_index(
        -n <= dim < n,
        lambda: (
            f"{op}: dim {dim} is out of range for {what}[{i}] of shape {tuple(x.shape)} (expected a dim in "
            f"[{-n}, {n - 1}])"
        ),
    )
    return dim + n if dim < 0 else dim


def check_transpose01(xs: Sequence[Tensor]) -> None:
    check_same_device("transpose01", xs)
    for i, x in enumerate(xs):
        torch._check_value(
            x.dim() >= 2,
            lambda i=i, x=x: (
                f"transpose01: tensors[{i}] has shape {tuple(x.shape)} ({x.dim()} dims); every tensor needs at "
                "least 2 dims to swap dims 0 and 1"
            ),
        )


def check_split(op: str, xs: Sequence[Tensor], dim: int, sizes: Sequence[int]) -> list[int]:
    """Chunk sizes >= 0 summing to each tensor's size along ``dim`` (wrapped per tensor); returns the wrapped dims."""
    check_same_device(op, xs)
    for j, s in enumerate(sizes):
        torch._check_value(s >= 0, lambda j=j, s=s: f"{op}: sizes[{j}] is {s}; chunk sizes must be >= 0")
    total = sum(sizes)
    if isinstance(total, int) and total > INT64_MAX:  # the C++ sum would wrap around
        raise ValueError(f"{op}: sizes {list(sizes)} sum past 2**63 - 1; the sizes must sum to the size of dim {dim}")
    dims = []
    for i, x in enumerate(xs):
        d = wrap_dim(op, "tensors", i, x, dim)
        torch._check_value(
            total == x.shape[d],
            lambda i=i, x=x, d=d: (
                f"{op}: sizes {list(sizes)} sum to {total} but tensors[{i}] has size {x.shape[d]} along dim "
                f"{dim} (shape {tuple(x.shape)}); the sizes must sum to that axis"
            ),
        )
        dims.append(d)
    return dims


def check_scatter(sizes: Sequence[int], devices: Sequence[torch.device]) -> None:
    if len(sizes) != len(devices):
        raise ValueError(f"scatter: got {len(sizes)} sizes but {len(devices)} devices; give one device per chunk size")


def check_gather(chunks: Sequence[Tensor], dim: int) -> tuple[int, list]:
    """The wrapped dim and the output shape of ``gather(chunks, dim, ...)``."""
    op = "gather"
    if len(chunks) == 0:
        raise ValueError("gather: chunks is empty; give at least one tensor to concatenate")
    ref = chunks[0]
    d = wrap_dim(op, "chunks", 0, ref, dim)
    shape = list(ref.shape)
    shape[d] = 0
    for i, c in enumerate(chunks):
        wrap_dim(op, "chunks", i, c, dim)
        same = (
            c.dim() == ref.dim()
            and c.dtype == ref.dtype
            and all(k == d or a == b for k, (a, b) in enumerate(zip(c.shape, ref.shape)))
        )
        torch._check_value(
            same,
            lambda i=i, c=c: (
                f"gather: chunks[{i}] has shape {tuple(c.shape)} and dtype {c.dtype} but chunks[0] has "
                f"{tuple(ref.shape)} and {ref.dtype}; chunks must agree in dtype and in every dim except {dim}"
            ),
        )
        shape[d] = shape[d] + c.shape[d]
        if isinstance(shape[d], int) and shape[d] > INT64_MAX:
            raise ValueError(f"gather: the chunks' sizes along dim {dim} sum past 2**63 - 1")
    check_nbytes(op, "the output", shape, ref.element_size())
    return d, shape


def check_nbytes(op: str, what: str, shape: Sequence[int], element_size: int) -> None:
    n = element_size
    for s in shape:
        n = n * s
    if isinstance(n, int) and n > INT64_MAX:
        raise ValueError(f"{op}: {what} of shape {tuple(shape)} would hold more than 2**63 - 1 bytes")


def check_meta_copy(op: str, what: str, xs: Sequence[Tensor], devices: Sequence[torch.device]) -> None:
    """A meta tensor holds no data: copying one to a real device is refused, as ``Tensor.to`` refuses it."""
    for i, x in enumerate(xs):
        if x.device.type == "meta":
            for dev in devices:
                if dev.type != "meta":
                    raise NotImplementedError(
                        f"{op}: {what}[{i}] is a meta tensor, which holds no data to copy to {dev} (cannot copy "
                        "out of meta tensor); use meta tensors throughout, or real ones"
                    )
