"""How many samples each device (or rank) gets: an even split, or one proportional to ``chunk_sizes`` weights.

Splits are contiguous and in the caller's order, and always sum to ``B``: nothing is dropped or repeated.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction


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
        out.append(Fraction(int(w)) if isinstance(w, numbers.Integral) else Fraction(w))
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
