"""How many samples each device (or rank) gets: an even split, one proportional to ``chunk_sizes`` weights, or one
that balances per-sample costs (:func:`balanced_split`).

Splits are contiguous and in the caller's order, and always sum to ``B``: nothing is dropped or repeated.
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from fractions import Fraction
from typing import overload

from torch import Tensor

from ..ext.loader import C

_MASK64 = (1 << 64) - 1
_NATIVE_BITS = 126  # dpfast._C._balanced_bounds keeps every counted cost below 2^126


def validate_chunk_sizes(chunk_sizes: Sequence[float] | None, n_devices: int) -> list[Fraction] | None:
    """Relative weights per device (exact fractions), or ``None`` for an even split."""
    if chunk_sizes is None:
        return None
    if isinstance(chunk_sizes, (str, bytes)) or not hasattr(chunk_sizes, "__len__"):
        raise TypeError(
            f"chunk_sizes must be a sequence of relative weights, one per device, got {type(chunk_sizes).__name__}"
        )
    weights = list(chunk_sizes)
    if len(weights) != n_devices:
        raise ValueError(
            f"chunk_sizes has {len(weights)} weights but there are {n_devices} device_ids; give one weight per "
            "device (0 skips a device)"
        )
    out = []
    for i, w in enumerate(weights):
        # numbers.Real takes numpy's ints and floats too; bool (an int) is almost surely a mistake
        if isinstance(w, bool) or type(w).__name__ == "bool_" or not isinstance(w, numbers.Real):
            raise TypeError(f"chunk_sizes[{i}] is {type(w).__name__} {w!r}; weights are ints or floats")
        if not isinstance(w, numbers.Rational) and not math.isfinite(w):
            raise ValueError(f"chunk_sizes[{i}] is {w!r}; weights must be finite")
        if w < 0:
            raise ValueError(f"chunk_sizes[{i}] is {w!r}; weights must be >= 0 (0 skips that device)")
        # float(): numpy's floats are Reals that Fraction does not take
        out.append(Fraction(int(w)) if isinstance(w, numbers.Integral) else Fraction(float(w)))
    if sum(out) == 0:
        raise ValueError(f"chunk_sizes {weights!r} are all zero; at least one device needs a positive weight")
    return out


def split_sizes(batch: int, n: int, weights: Sequence[Fraction] | None = None) -> list[int]:
    """Per-device chunk sizes summing to ``batch``: as even as possible (earlier devices take the remainder), or
    proportional to ``weights`` by largest remainder (ties to earlier devices; weight 0 always gets 0)."""
    if batch < 0:
        raise ValueError(f"batch size must be >= 0, got {batch}")
    if weights is None:
        q, r = divmod(batch, n)
        return [q + (1 if i < r else 0) for i in range(n)]
    if len(weights) != n:
        raise ValueError(f"got {len(weights)} weights for {n} devices")
    total = sum(weights)
    quotas = [Fraction(batch) * w / total for w in weights]
    sizes = [math.floor(q) for q in quotas]
    left = batch - sum(sizes)
    order = sorted((i for i in range(n) if weights[i] > 0), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in order[:left]:
        sizes[i] += 1
    return sizes


def balanced_split(prefix: Sequence[int], n: int, weights: Sequence[Fraction] | None = None) -> list[int]:
    """Contiguous per-device sizes that minimize the largest device cost relative to its weight.

    ``prefix`` holds the prefix sums of ``B`` non-negative **integer** costs (``prefix[0] == 0``, ``B =
    len(prefix) - 1``; :mod:`dpfast.plan.costs` makes any costs exact integers). Weight-0 devices get nothing.

    Exact: scale the weights to integers ``W_j`` with ``L = lcm(W)``; a device's cost ``C`` then counts as the
    integer ``C * (L // W_j)``, so the optimum ``U*`` is an integer and the smallest ``U`` at which the devices, in
    order, each taking the longest prefix of the rest whose count is ``<= U``, cover the batch (that greedy covers
    the batch at ``U`` exactly when some split does). A binary search over integers finds it; every comparison is
    between integers, so nothing is rounded.

    Ties (several splits reach ``U*``): the boundaries are the count split's (:func:`split_sizes`) where an optimal
    split allows, else the nearest that does, decided from the first boundary to the last. So the count split is
    kept whenever it is optimal (equal costs, all costs zero), and the result is deterministic.
    """
    batch = len(prefix) - 1
    count = split_sizes(batch, n, weights)
    active = [j for j in range(n) if weights is None or weights[j] > 0]
    if batch == 0 or len(active) == 1 or prefix[-1] == 0:
        return count
    k = len(active)
    mult, lcm, total_weight = _multipliers([Fraction(1)] * k if weights is None else [weights[j] for j in active])
    targets = list(_cumulative([count[j] for j in active]))
    hi = max((prefix[b] - prefix[a]) * m for a, b, m in zip([0] + targets, targets, mult))
    # every device's cost is at most U // m_j, so the total is at most U * sum(W) / L: a lower bound for U
    lo = min(-(-prefix[-1] * lcm // total_weight), hi)
    if isinstance(prefix, WidePrefix):
        if max(mult).bit_length() < 64 and (prefix[-1] * max(mult)).bit_length() <= _NATIVE_BITS:
            halves = (lo >> 64, lo & _MASK64, hi >> 64, hi & _MASK64)
            return _sizes(C._balanced_bounds(prefix.pairs, mult, targets, *halves), active, n)
        prefix = prefix.ints()
    return _sizes(_search(prefix, mult, targets, lo, hi), active, n)


def _search(prefix: Sequence[int], mult: list[int], targets: list[int], lo: int, hi: int) -> list[int]:
    """The boundaries of :func:`balanced_split` for the active devices (``dpfast._C._balanced_bounds`` is the same
    search in 128-bit integers)."""
    batch, k = len(prefix) - 1, len(mult)

    def covers(u: int) -> int | None:
        """The largest counted cost of the greedy split at ``u`` (``<= u``), or None when it leaves samples."""
        end, top = 0, 0
        for m in mult:
            start = end
            end = bisect_right(prefix, prefix[start] + u // m, start) - 1
            top = max(top, (prefix[end] - prefix[start]) * m)
            if end == batch:
                return top
        return None

    while lo < hi:
        mid = (lo + hi) // 2
        top = covers(mid)
        if top is None:
            lo = mid + 1
        else:
            hi = top
    caps = [lo // m for m in mult]
    # low[j]: the earliest start from which devices j..k-1 can still cover the rest (the greedy from the right)
    low = [0] * (k + 1)
    low[k] = batch
    for j in range(k - 1, 0, -1):
        low[j] = bisect_left(prefix, prefix[low[j + 1]] - caps[j], 0, low[j + 1])
    bounds = [0]
    for j in range(k - 1):
        start = bounds[-1]
        reach = bisect_right(prefix, prefix[start] + caps[j], start) - 1
        bounds.append(min(max(targets[j], low[j + 1], start), reach))
    bounds.append(batch)
    return bounds


def _sizes(bounds: list[int], active: list[int], n: int) -> list[int]:
    sizes = [0] * n
    for j, a, b in zip(active, bounds, bounds[1:]):
        sizes[j] = b - a
    return sizes


class WidePrefix(Sequence):
    """Prefix sums of integer costs held as 128-bit integers: ``pairs``, a ``(B + 1, 2)`` int64 tensor of (high,
    low) 64-bit halves, from ``dpfast._C._exact_prefix``. Read as Python ints on access, so a split that reads a
    few of them never builds ``B`` of them."""

    def __init__(self, pairs: Tensor):
        self.pairs = pairs
        try:
            self._flat: Sequence[int] = memoryview(pairs.numpy()).cast("B").cast("q")
        except (RuntimeError, TypeError, ValueError):  # no numpy
            self._flat = pairs.flatten().tolist()

    def __len__(self) -> int:
        return self.pairs.shape[0]

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("prefix index out of range")
        return (self._flat[2 * i] << 64) | (self._flat[2 * i + 1] & _MASK64)

    def ints(self) -> list[int]:
        """All of them, as a list (for the Python search, when the numbers are too wide for the native one)."""
        f = self._flat
        return [(h << 64) | (lo & _MASK64) for h, lo in zip(f[0::2], f[1::2])]


def _cumulative(sizes: Sequence[int]):
    total = 0
    for s in sizes:
        total += s
        yield total


def _multipliers(weights: Sequence[Fraction]) -> tuple[list[int], int, int]:
    """Positive weights scaled to coprime integers ``W``: ``([L // W_j], L, sum(W))`` with ``L = lcm(W)``. A cost
    ``C`` on device ``j`` counts as ``C * (L // W_j)``, an integer ordered as ``C / weight_j`` is."""
    den = math.lcm(*(w.denominator for w in weights))
    ints = [w.numerator * (den // w.denominator) for w in weights]
    g = math.gcd(*ints)
    ints = [w // g for w in ints]
    lcm = math.lcm(*ints)
    return [lcm // w for w in ints], lcm, sum(ints)
