"""``cost=``: where a call's per-sample costs are, their exact values, and what a split costs per device.

``cost`` is the name of a ``forward`` parameter (``"lengths"``), a path into one (``"batch['lengths']"``,
``"batch.lengths"``, ``"h[0]"``), or a callable taking the call's arguments as ``forward`` does. Its value holds ``B``
finite numbers ``>= 0``: a 1-D tensor, a list/tuple/numpy array of numbers, or a ``PackedSequence`` (its sequence
lengths, in the caller's order).

Costs become exact integers times one common scale (a float is an integer times a power of two, so shifting by
the smallest exponent loses nothing). :func:`dpfast.plan.splits.balanced_split` then compares sums of costs without
rounding: float prefix sums could rank two splits wrongly, or differently on two ranks. Tensors and lists of
costs go to ``dpfast._C._exact_prefix`` (128-bit prefix sums, no Python int per sample); the code here is the same
arithmetic on Python ints, for sums of 125 bits or more, ints beyond int64, mixed numbers, and without the
extension.
"""

from __future__ import annotations

import array
import ast
import dataclasses
import math
import numbers
from collections.abc import Sequence
from fractions import Fraction
from itertools import accumulate
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from ..ext.loader import C
from ..trees.binding import Binding, BoundArguments
from ..trees.containers import child_path, describe_value
from .splits import WidePrefix

_INT64_MAX = 2**63 - 1
_WHAT = "costs are one number per sample: a 1-D tensor, a list or tuple of numbers, or a PackedSequence"


class CostSource:
    """Where a call's per-sample costs come from (``cost=``), checked against ``forward``'s signature once;
    :meth:`read` takes one call's costs from its bound arguments."""

    def __init__(self, cost: str | Callable[..., Any], specs: Binding):
        self.specs = specs
        self.fn: Callable[..., Any] | None = None
        self.keys: list[tuple[str, Any]] = []
        if isinstance(cost, str):
            self.root, self.keys = _parse_path(cost)
            self.label = f"cost={cost!r}"
            self.text = self.root + "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in self.keys)
            self._check_root(cost)
        elif callable(cost) and not isinstance(cost, (Tensor, PackedSequence)):
            self.fn = cost
            name = getattr(cost, "__qualname__", None) or getattr(cost, "__name__", None) or type(cost).__name__
            name = name.rsplit("<locals>.", 1)[-1]
            self.label = f"cost={name}"
            self.text = f"{name}(...)"
        else:
            raise TypeError(
                "cost must be the name of a forward parameter holding per-sample costs ('lengths'), a path into "
                "one (\"batch['lengths']\"), or a callable taking the call's arguments and returning them; got "
                f"{type(cost).__name__} {cost!r}"[:400]
            )

    def _check_root(self, cost: str) -> None:
        s = self.specs
        if not s.has_signature:
            if self.root not in ("args", "kwargs"):
                raise TypeError(
                    f"cost={cost!r}, but the signature of {s.forward_name} cannot be read to bind names; start the "
                    'path at args or kwargs ("args[1]", "kwargs[\'lengths\']"), or give cost a callable'
                )
            return
        known = s.known_names
        if self.root not in known and s.var_kw is None:
            raise TypeError(
                f"cost={cost!r} names no parameter of {s.signature_text}; known names: "
                f"{', '.join(known) if known else '(none)'}"
            )

    def read(self, call: BoundArguments, batch: int) -> Costs:
        """This call's costs as exact integers; raises ``TypeError``/``ValueError`` naming ``cost``."""
        if self.fn is not None:
            try:
                value = self.fn(*call.args, **call.kwargs)
            except Exception as exc:  # noqa: BLE001 - reworded with `cost` in it, so a rank can report it too
                kind = TypeError if isinstance(exc, TypeError) else ValueError
                raise kind(f"{self.label} raised {type(exc).__name__}: {exc}") from exc
        else:
            value = self._value(call)
        return read_costs(value, batch, self.label)

    def _value(self, call: BoundArguments) -> Any:
        name = self.root
        try:
            value = call.value_of(name)
        except KeyError:
            raise ValueError(
                f"{self.label}, but this call does not pass `{name}`; pass it (by position or keyword), or give "
                "cost a callable that finds the costs in the call's arguments"
            ) from None
        path = name
        for kind, key in self.keys:
            try:
                value = getattr(value, key) if kind == "attr" else value[key]
            except (KeyError, IndexError, TypeError, AttributeError):
                raise ValueError(
                    f"{self.label}, but `{path}` is {describe_value(value)}, which has no "
                    f"{'field' if kind == 'attr' else 'key'} {key!r}"
                ) from None
            path = f"{path}.{key}" if kind == "attr" else child_path(path, "dict", key)
        return value


def _parse_path(text: str) -> tuple[str, list[tuple[str, Any]]]:
    """``"batch['a'][0].b"`` -> ``("batch", [("item", "a"), ("item", 0), ("attr", "b")])``."""
    bad = ValueError(
        f"cost={text!r} is not a path: give a forward parameter name, then [key] or .field parts, like "
        '"batch[\'lengths\']" or "batch.lengths" (or give cost a callable)'
    )
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise bad from None
    keys: list[tuple[str, Any]] = []
    while not isinstance(node, ast.Name):
        if isinstance(node, ast.Attribute):
            keys.append(("attr", node.attr))
        elif isinstance(node, ast.Subscript):
            try:
                key = ast.literal_eval(node.slice)
            except ValueError:
                raise bad from None
            if isinstance(key, (bool, float, complex)) or not isinstance(key, (str, int, bytes, tuple)):
                raise bad
            keys.append(("item", key))
        else:
            raise bad
        node = node.value
    return node.id, keys[::-1]


@dataclasses.dataclass
class Costs:
    """``B`` costs as exact integers: sample ``i`` costs ``(prefix[i + 1] - prefix[i]) * scale``."""

    prefix: Sequence[int]
    scale: Fraction = Fraction(1)

    def per_part(self, sizes: Sequence[int]) -> list[int | float]:
        """Each device's cost, as the caller's numbers: ints, or floats when the costs were not all integers."""
        out: list[int | float] = []
        start = 0
        for s in sizes:
            c = self.prefix[start + s] - self.prefix[start]
            start += s
            if self.scale != 1:
                c = int(c * self.scale) if self.scale.denominator == 1 else float(c * self.scale)
            out.append(c)
        return out


def read_costs(value: Any, batch: int, label: str) -> Costs:
    """Check ``value`` holds ``batch`` finite costs ``>= 0`` and make them exact (errors name ``label``)."""
    if isinstance(value, PackedSequence):
        value = packed_lengths(value)
    if isinstance(value, Tensor):
        return _tensor_costs(value, batch, label)
    if hasattr(value, "__array__") and hasattr(value, "tolist") and hasattr(value, "ndim"):  # numpy
        if value.ndim != 1:
            raise TypeError(f"{label} is an array of shape {tuple(value.shape)}; {_WHAT}")
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{label} is {describe_value(value)}; {_WHAT}")
    _check_length(len(value), batch, label)
    kinds = set(map(type, value))
    if kinds <= {int}:
        if value and C is not None:
            try:
                native = _native_costs(torch.frombuffer(array.array("q", value), dtype=torch.int64))
            except OverflowError:  # beyond int64: Python ints below
                native = None
            if native is not None:
                return native
        low = min(value, default=0)
        if low < 0:
            _negative(label, value.index(low), low)
        return Costs(list(accumulate(value, initial=0)))
    if kinds <= {float}:  # through array: torch.tensor(list) costs several times more
        return _tensor_costs(torch.frombuffer(array.array("d", value), dtype=torch.float64), batch, label)
    return _exact_costs(value, label)


def packed_lengths(ps: PackedSequence) -> Tensor:
    """A PackedSequence's sequence lengths in the caller's order, from ``batch_sizes`` alone (no data touched)."""
    bs = ps.batch_sizes
    n = int(bs[0]) if bs.numel() else 0
    # the k-th longest sequence runs for as many steps as have more than k sequences
    lengths = bs.numel() - torch.searchsorted(bs.flip(0), torch.arange(n, dtype=bs.dtype), right=True)
    if ps.unsorted_indices is not None:
        lengths = lengths[ps.unsorted_indices.cpu()]
    return lengths


def _check_length(n: int, batch: int, label: str) -> None:
    if n != batch:
        raise ValueError(
            f"{label} has {n} values but B = {batch} (the batch being split); give one cost per sample, in the "
            "batch's order"
        )


def _negative(label: str, i: int, v: Any) -> None:
    raise ValueError(f"{label}: sample {i} has cost {v}; costs must be >= 0 (a sample's work, e.g. its length)")


def _not_finite(label: str, i: int, v: Any) -> None:
    raise ValueError(f"{label}: sample {i} has cost {v}; costs must be finite")


def _tensor_costs(t: Tensor, batch: int, label: str) -> Costs:
    if t.layout != torch.strided:
        raise TypeError(
            f"{label} is a sparse tensor (layout {t.layout}); costs are a dense 1-D tensor: pass it .to_dense(), "
            "or a list of numbers"
        )
    if t.dim() != 1:
        raise TypeError(f"{label} is a Tensor of shape {tuple(t.shape)}; {_WHAT}")
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{label} is a {str(t.dtype).replace('torch.', '')} tensor; costs are real numbers")
    if t.device.type == "meta":
        raise TypeError(f"{label} is on meta; its values are needed to balance the split: pass real costs")
    _check_length(t.shape[0], batch, label)
    if type(t) is Tensor:
        return _dense_costs(t.detach().cpu(), label)
    try:  # a subclass: read through torch's ops, which some subclasses (wrappers) do not let reach their values
        return _dense_costs(t.detach().cpu(), label)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise TypeError(
            f"{label} is a {type(t).__name__} (a tensor subclass) whose values cannot be read ({exc}"[:300] + "); "
            "pass the costs as a plain tensor or a list of numbers"
        ) from exc


def _dense_costs(t: Tensor, label: str) -> Costs:
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):  # never negative; few ops support them
        return Costs(list(accumulate(t.tolist(), initial=0)))
    native = _native_costs(t)
    if native is not None:
        return native
    if t.is_floating_point():
        t = t.double()
        bad = ~torch.isfinite(t)
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            _not_finite(label, i, t[i].item())
    if t.numel() and bool((t < 0).any()):
        i = int((t < 0).nonzero()[0, 0])
        _negative(label, i, t[i].item())
    return _float_costs(t) if t.is_floating_point() else _int_costs(t.long())


def _native_costs(t: Tensor) -> Costs | None:
    """The costs as 128-bit prefix sums from ``dpfast._C._exact_prefix`` (the arithmetic below, without a Python
    int per sample); None where it declines (a bad sample: the checks below word the error; sums of 125 bits or
    more) or the extension is not loaded."""
    if C is None or type(t) is not Tensor or t.layout != torch.strided or t._is_zerotensor():
        return None  # subclasses, sparse and zero tensors: the reference reads them through torch's ops
    t = (t.double() if t.is_floating_point() else t.long()).resolve_neg().contiguous()
    _bad, exp, pairs = C._exact_prefix(t)
    if pairs is None:
        return None
    return Costs(WidePrefix(pairs), Fraction(2) ** exp)


def _int_costs(t: Tensor, scale: Fraction = Fraction(1)) -> Costs:
    if t.numel() == 0 or int(t.max()) <= _INT64_MAX // t.numel():  # the sums fit in int64
        return Costs(_as_ints(torch.cat([t.new_zeros(1), torch.cumsum(t, 0)])), scale)
    return Costs(list(accumulate(t.tolist(), initial=0)), scale)


def _as_ints(t: Tensor) -> Sequence[int]:
    """A 1-D int64 tensor as a sequence of Python ints: a memoryview over its buffer where numpy is there (it reads
    ints on access; a list of ``B`` ints would cost more than the whole search), else a list."""
    try:
        return memoryview(t.numpy())
    except (RuntimeError, TypeError, ValueError):  # no numpy
        return t.tolist()


def _float_costs(t: Tensor) -> Costs:
    """Exact integers for float64 costs: ``t = m * 2**e`` with an integer ``m``; shift all to the smallest ``e``."""
    nz = t != 0
    if not nz.any():
        return Costs([0] * (t.numel() + 1))
    if torch.equal(t, t.trunc()) and float(t.max()) < 2.0**62:
        return _int_costs(t.long())
    mant, exp = torch.frexp(t)
    m = (mant * 2.0**53).long()  # exact: a float64 significand has 53 bits
    # strip trailing zero bits (fewer bits to add up): the lowest set bit 2**k has frexp exponent k + 1
    tz = (torch.frexp((m & -m).double())[1] - 1).clamp_(min=0)
    m >>= tz
    e = exp + tz - 53
    e_min = int(e.masked_fill(~nz, torch.iinfo(e.dtype).max).min())
    shift = (e - e_min).masked_fill_(~nz, 0).long()
    bits = int((torch.frexp(m.double())[1] + shift).max())
    scale = Fraction(2) ** e_min
    if bits + t.numel().bit_length() <= 63:
        return _int_costs(m << shift, scale)
    return Costs(list(accumulate((a << b for a, b in zip(m.tolist(), shift.tolist())), initial=0)), scale)


def _exact_costs(values: Sequence[Any], label: str) -> Costs:
    """Mixed numbers (ints with floats, numpy scalars, Fractions): each as an exact ratio, on a common denominator."""
    ratios = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or type(v).__name__ == "bool_" or not isinstance(v, numbers.Real):
            raise TypeError(
                f"{label}: sample {i} is {type(v).__name__} {v!r}; costs are numbers (ints or floats)"[:300]
            )
        if isinstance(v, numbers.Integral):
            num, den = int(v), 1
        elif isinstance(v, numbers.Rational):
            num, den = int(v.numerator), int(v.denominator)
        else:
            f = float(v)
            if not math.isfinite(f):
                _not_finite(label, i, f)
            num, den = f.as_integer_ratio()
        if num < 0:
            _negative(label, i, v)
        ratios.append((num, den))
    common = math.lcm(*(d for _, d in ratios)) if ratios else 1
    return Costs(list(accumulate((n * (common // d) for n, d in ratios), initial=0)), Fraction(1, common))


class Balance:
    """What a cost-balanced split costs per device, next to the count split (for ``plan()``; computed when read, so
    a call that only runs pays nothing for it)."""

    def __init__(
        self, costs: Costs, label: str, sizes: Sequence[int], count: Sequence[int], weights: Sequence[Fraction] | None
    ):
        self.label = label  # where the costs came from: the path, or ``fn(...)``
        self.sizes = list(sizes)
        self.count_sizes = list(count)
        self.weighted = weights is not None
        self._costs = costs
        self._weights = weights

    @property
    def costs(self) -> list:
        """Each device's cost (0 where a device gets nothing)."""
        return self._costs.per_part(self.sizes)

    @property
    def count_costs(self) -> list:
        return self._costs.per_part(self.count_sizes)

    @property
    def imbalance(self) -> float:
        """The largest device cost over the mean (each relative to its chunk_sizes weight): 1.0 is a perfect balance."""
        return _imbalance(self._costs, self.sizes, self._weights)

    @property
    def count_imbalance(self) -> float:
        return _imbalance(self._costs, self.count_sizes, self._weights)


def _imbalance(costs: Costs, sizes: Sequence[int], weights: Sequence[Fraction] | None) -> float:
    """``max_j C_j / w_j`` over ``total / sum(w)``."""
    total = costs.prefix[-1]
    if total == 0:
        return 1.0
    w = [Fraction(1)] * len(sizes) if weights is None else list(weights)
    worst, start = Fraction(0), 0
    for s, wj in zip(sizes, w):
        if wj > 0:
            worst = max(worst, (costs.prefix[start + s] - costs.prefix[start]) / wj)
        start += s
    return float(worst * sum(w) / total)
