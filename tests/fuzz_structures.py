"""A seeded structural fuzzer of planning and calls: random argument trees through an identity module.

Each round builds a call (random nestings of list, tuple, dict, OrderedDict, defaultdict, UserDict,
MappingProxyType, deque, namedtuple, dataclasses; tensors of every dtype incl. float8 and complex with odd strides,
channels_last, PackedSequence, jagged nested and quantized tensors, opaque objects, lists of numbers, "items"
lists) and its ``in_dims``; one round in three gets a hostile mutation (a cycle, a wrong or numpy spec, a batch
size that disagrees, a 0-dim, sparse or strided-nested tensor under a split spec, a non-tensor under an explicit
one, a Mapping whose iteration never ends), one in six a benign oddity (nesting thousands deep, a tuple posing as
a namedtuple, a dataclass with an unset field, a list of 10**5 numbers, a list shared twice, a torch.return_types
value). It plans and runs it on ``["cpu"] * n`` through a module that returns its arguments, with ``out_dims``
mirroring ``in_dims``. The oracle:

- a call that succeeds returns exactly its input (same types and structure, tensors with the same dtype, shape and
  bytes (memory formats are tests/test_memory_format.py's), opaque objects by identity), and ``plan()`` succeeded
  too; a mutated call never succeeds;
- otherwise ``plan()`` and the call raise the same dpfast error, a ``TypeError``/``ValueError`` (``ScatterError``
  is one) whose message names the argument (a path in backquotes, or ``in_dims``/``out_dims``);
- never any other exception.

    python tests/fuzz_structures.py --seconds 60 --seed 0

``make sanitize`` runs it against the AddressSanitizer/UBSan build; ``tests/test_fuzz_structures.py`` runs a short
seeded run in the suite. Exit status 1 when a round fails, with its seed (replay: ``--seed S --rounds 1``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import random
import sys
import time
import types
import warnings
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

import dpfast


def _copyable(dtype: torch.dtype) -> bool:
    """Whether this torch copies ``dtype`` (older ones have the unsigned 16-64 bit dtypes as shells only)."""
    try:
        x = torch.zeros(16, dtype=torch.uint8).view(dtype).reshape(2, -1)
        torch.empty(x.shape, dtype=dtype).copy_(x.t().contiguous().t()).reshape(-1).view(torch.uint8)
        return True
    except (RuntimeError, TypeError):
        return False


_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "uint16", "uint32", "uint64")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128]
DTYPES += [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]
DTYPES += [d for d in (getattr(torch, n, None) for n in _NAMES) if d is not None and _copyable(d)]
DEEP = 3000  # the deepest nesting a benign round builds (torch's own scatter stops near 990)


class Pair(NamedTuple):
    a: Any
    b: Any


@dataclasses.dataclass
class Box:
    x: Any
    tag: Any = "box"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: Any
    y: Any = None


@dataclasses.dataclass
class Unset:
    x: Any
    later: Any = dataclasses.field(init=False)  # never set


class LooksNamed(tuple):
    """A tuple subclass with a ``_fields`` attribute that is no namedtuple (it names one of its two elements)."""

    _fields = ("a",)


class Endless(Mapping):
    """A Mapping whose iteration never ends (its len() says 2)."""

    def __init__(self, x):
        self.x = x

    def __getitem__(self, k):
        return self.x

    def __len__(self):
        return 2

    def __iter__(self):
        n = 0
        while True:
            yield f"k{n}"
            n += 1


class Opaque:
    """An object dpfast passes by reference."""


class Identity(nn.Module):
    """Returns its arguments; forward names them a0, a1, ... so that in_dims can be a dict."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, a0=None, a1=None, a2=None, a3=None, a4=None):
        return (a0, a1, a2, a3, a4)[: self.n]


# ---- building a call ---------------------------------------------------------------------------------------------


class Gen:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)

    def tensor(self, shape: list[int]) -> torch.Tensor:
        """Random bytes (NaN payloads included) of a random dtype in a random memory layout."""
        dtype = self.r.choice(DTYPES)
        layout = self.r.choice(["contiguous", "contiguous", "transposed", "sliced", "expanded", "channels_last"])
        base = list(shape) + [2] if layout == "sliced" else list(shape)  # every other element of a wider tensor
        n = _numel(base) * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (n,), generator=self.g, dtype=torch.uint8)
        t = ((raw & 1).bool() if dtype == torch.bool else raw.view(dtype)).reshape(base)
        if layout == "sliced":
            t = t[..., 0]
        elif layout == "transposed" and len(shape) >= 2:
            t = t.transpose(-1, -2).contiguous().transpose(-1, -2)
        elif layout == "expanded" and len(shape) >= 2 and shape[-1] > 0:
            t = t[..., :1].expand(shape)
        elif layout == "channels_last" and len(shape) == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        return t

    def batched(self, b: int, axes: int = 3) -> tuple[torch.Tensor, int]:
        """A tensor with the batch ``b`` on one of its first ``axes`` axes, and that axis."""
        rank = self.r.randint(1, 4)
        shape = [self.r.choice([1, 2, 3]) for _ in range(rank)]
        axis = self.r.randrange(min(rank, axes))
        shape[axis] = b
        return self.tensor(shape), axis

    def value(self, b: int, depth: int) -> tuple[Any, Any]:
        """``(value, spec)``: a random subtree whose split leaves all have batch ``b``, and its in_dims spec."""
        r = self.r
        if depth <= 0 or r.random() < 0.35:
            return self.leaf(b)
        kind = r.choice(CONTAINERS + ["items"])
        if kind == "items":
            items = [self.tensor([r.randint(0, 3), 2]) for _ in range(b)]
            return (items if r.random() < 0.5 else tuple(items)), "items"
        low, high = {"pair": (2, 2), "looks_named": (2, 3), "box": (1, 2), "frozen": (1, 2)}.get(kind, (0, 3))
        n = r.randint(low, high)
        kids = [self.value(b, depth - 1) for _ in range(n)]
        return _container(kind, [v for v, _ in kids], [s for _, s in kids])

    def leaf(self, b: int) -> tuple[Any, Any]:
        r, pick = self.r, self.r.random()
        if pick < 0.45:
            return self.batched(b)
        if pick < 0.55:
            return self.tensor([r.choice([1, 2, 3]) for _ in range(r.randint(0, 3))]), None  # replicated
        if pick < 0.62 and b > 0:
            seqs = [torch.randn(r.randint(1, 4), 2, generator=self.g) for _ in range(b)]
            return pack_sequence(seqs, enforce_sorted=False), 0
        if pick < 0.67 and b > 0:
            parts = [torch.randn(r.randint(1, 3), 2, generator=self.g) for _ in range(b)]
            return torch.nested.nested_tensor(parts, layout=torch.jagged), 0
        if pick < 0.72:
            x = torch.randn(b, 3, generator=self.g)
            with warnings.catch_warnings():  # torch deprecates creating quantized tensors
                warnings.simplefilter("ignore")
                return torch.quantize_per_tensor(x, 0.05, r.randint(0, 5), torch.qint8), 0
        return r.choice([None, 3, 2.5, "tag", Opaque(), [1, 2, 3], ("a", "b")]), None


CONTAINERS = ["list", "tuple", "dict", "odict", "ddict", "userdict", "proxy", "deque", "pair", "box", "frozen"]
CONTAINERS += ["looks_named"]
MAPPINGS: dict[str, Callable[[dict], Any]] = {
    "dict": dict,
    "odict": collections.OrderedDict,
    "ddict": lambda d: collections.defaultdict(list, d),
    "userdict": collections.UserDict,
    "proxy": types.MappingProxyType,
}
SEQUENCES: dict[str, Callable[[list], Any]] = {"tuple": tuple, "looks_named": LooksNamed, "deque": collections.deque}


def _container(kind: str, values: list, specs: list) -> tuple[Any, Any]:
    """A container of ``kind`` holding ``values``, and the spec mirroring it."""
    if kind == "list":
        return values, specs
    if kind in SEQUENCES:
        return SEQUENCES[kind](values), tuple(specs)
    if kind == "pair":
        return Pair(values[0], values[1]), Pair(specs[0], specs[1])
    if kind in ("box", "frozen"):  # a dataclass, and a dict spec of the fields it was given
        cls, second = (Box, "tag") if kind == "box" else (Frozen, "y")
        fields = dict(zip(["x", second], values))
        return cls(**fields), dict(zip(fields, specs))
    return MAPPINGS[kind]({f"k{i}": v for i, v in enumerate(values)}), {f"k{i}": s for i, s in enumerate(specs)}


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- mutations -----------------------------------------------------------------------------------------------------


def _cycle_list(gen: Gen, b: int) -> tuple[Any, Any]:
    loop: list = [gen.batched(b, 1)[0]]
    loop.append(loop)
    return loop, None


def _cycle_dict(gen: Gen, b: int) -> tuple[Any, Any]:
    d: dict = {"x": gen.batched(b, 1)[0]}
    d["me"] = d
    return d, None


def _numpy_spec(gen: Gen, b: int) -> tuple[Any, Any]:
    import numpy as np

    return gen.batched(b, 1)[0], np.int64(0)


# each: (gen, b) -> (a value, its spec) that must make the call raise a dpfast error naming it
HOSTILE: dict[str, Callable[[Gen, int], tuple[Any, Any]]] = {
    "cycle_list": _cycle_list,
    "cycle_dict": _cycle_dict,
    "numpy_spec": _numpy_spec,
    "wrong_len_spec": lambda gen, b: ([gen.batched(b, 1)[0]] * 2, [0, 0, 0]),
    "unknown_key": lambda gen, b: ({"a": gen.batched(b, 1)[0]}, {"nope": 0}),
    "string_spec": lambda gen, b: (gen.batched(b, 1)[0], "sum"),
    "zero_dim": lambda gen, b: (torch.tensor(1.0), 0),
    "axis_out_of_range": lambda gen, b: (torch.zeros(b, 2), 5),
    "sparse": lambda gen, b: (torch.zeros(b, 3).to_sparse(), 0),
    "strided_nested": lambda gen, b: (torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), 0),
    "explicit_non_tensor": lambda gen, b: (Opaque(), 0),
    "endless_mapping": lambda gen, b: (Endless(torch.zeros(b, 2)), None),
}


def mutate(gen: Gen, args: list, specs: list, b: int) -> str:
    """Make the call hostile in place; returns what was done."""
    what = gen.r.choice(sorted(HOSTILE) + ["batch_mismatch"])
    if what == "batch_mismatch":  # two more arguments that disagree with each other
        args += [torch.zeros(b + 1, 2), torch.zeros(b + 2, 2)]
        specs += [0, 0]
    else:
        i = gen.r.randrange(len(args))
        args[i], specs[i] = HOSTILE[what](gen, b)
    return what


def benign(gen: Gen, args: list, specs: list, b: int) -> str:
    """Put in a hostile-looking value that must still round-trip exactly; returns what."""
    r = gen.r
    what = r.choice(["deep", "looks_named", "unset_field", "atoms", "shared", "return_types"])
    i = r.randrange(len(args))
    t, axis = gen.batched(b)
    if what == "deep":  # deeper than torch's own scatter (or any recursive walk) goes
        v: Any = t
        for _ in range(r.randint(DEEP // 2, DEEP)):
            v = [v]
        args[i], specs[i] = v, axis
    elif what == "looks_named":
        args[i], specs[i] = LooksNamed((t, t.clone())), axis
    elif what == "unset_field":
        args[i], specs[i] = Unset(t), axis
    elif what == "atoms":  # one leaf, by reference, however long
        args[i], specs[i] = list(range(r.randint(1, 100_000))), None
    elif what == "shared":  # the same list twice (no cycle)
        inner = [t]
        args[i], specs[i] = [inner, inner], axis
    else:  # a torch.return_types structseq
        args[i], specs[i] = torch.max(torch.zeros(b, 3), 1), 0
    return what


# ---- the oracle ----------------------------------------------------------------------------------------------------


def same(a: Any, e: Any, path: str = "out") -> str | None:
    """Why ``a`` is not exactly ``e`` (None when it is), without recursion (deep trees)."""
    stack = [(a, e, path)]
    while stack:
        a, e, p = stack.pop()
        if type(a) is not type(e):
            return f"{p}: {type(a).__name__} != {type(e).__name__}"
        if isinstance(e, torch.Tensor):
            why = _tensor_differs(a, e)
            if why:
                return f"{p}: {why}"
        elif isinstance(e, PackedSequence):
            (pa, la), (pe, le) = pad_packed_sequence(a, batch_first=True), pad_packed_sequence(e, batch_first=True)
            if not torch.equal(la, le) or _tensor_differs(pa, pe) is not None:
                return f"{p}: PackedSequence differs"
        elif isinstance(e, Mapping):
            if list(a.keys()) != list(e.keys()):
                return f"{p}: keys {list(a.keys())} != {list(e.keys())}"
            stack.extend((a[k], e[k], f"{p}[{k!r}]") for k in e)
        elif isinstance(e, (tuple, list, collections.deque)):
            if len(a) != len(e):
                return f"{p}: length {len(a)} != {len(e)}"
            stack.extend((x, y, f"{p}[{i}]") for i, (x, y) in enumerate(zip(a, e)))
        elif dataclasses.is_dataclass(e):
            for f in dataclasses.fields(e):
                if hasattr(a, f.name) != hasattr(e, f.name):
                    return f"{p}.{f.name}: set on one side only"
                if hasattr(e, f.name):
                    stack.append((getattr(a, f.name), getattr(e, f.name), f"{p}.{f.name}"))
        elif a is not e and not (type(e) in (int, float, str, bool) and a == e):
            return f"{p}: {a!r} is not {e!r}"
    return None


def _tensor_differs(a: torch.Tensor, e: torch.Tensor) -> str | None:
    if a.is_nested or e.is_nested:  # a jagged shape's ragged size is a new symbol per tensor: compare the parts
        if not (a.is_nested and e.is_nested and a.layout == e.layout and torch.equal(a.offsets(), e.offsets())):
            return "nested tensor differs"
        return _tensor_differs(a.values(), e.values())
    if a.dtype != e.dtype or a.shape != e.shape or a.layout != e.layout:
        return f"{a.dtype} {tuple(a.shape)} != {e.dtype} {tuple(e.shape)}"
    if e.is_quantized:
        qparams = (a.q_scale(), a.q_zero_point()) == (e.q_scale(), e.q_zero_point())
        return None if qparams and torch.equal(a.int_repr(), e.int_repr()) else "quantized tensor differs"
    last = torch.channels_last
    if (
        e.dim() == 4
        and not e.is_contiguous()
        and e.is_contiguous(memory_format=last)
        and not a.is_contiguous(memory_format=last)
    ):
        return "channels_last lost"
    if e.numel() and not torch.equal(_bytes(a), _bytes(e)):
        return "bytes differ"
    return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()).reshape(-1)  # canonical strides, size-1 axes too
    return flat if flat.dtype == torch.bool else flat.view(torch.uint8)


def names_the_argument(message: str) -> bool:
    return "`" in message or "in_dims" in message or "out_dims" in message


DPFAST_ERRORS = (TypeError, ValueError)  # dpfast.ScatterError is a ValueError


def build(seed: int) -> tuple[list, dict, str | None, int, int]:
    """One round's call: ``(args, in_dims, mutation or None, B, devices)``."""
    gen = Gen(seed)
    r = gen.r
    b = r.choice([0, 1, 2, 3, 5, 7, 8])
    args, specs = [], []
    for _ in range(r.randint(1, 3)):
        v, s = gen.value(b, r.randint(0, 3))
        args.append(v)
        specs.append(s)
    mutation = None
    roll = r.random()
    if roll < 1 / 3:
        mutation = mutate(gen, args, specs, b)
    elif roll < 0.5:
        benign(gen, args, specs, b)
    # an argument whose spec is the default dim (0) is left out of in_dims half the time (not a mutated call's:
    # a non-tensor under the default spec is passed by reference, under an explicit one it is an error)
    keep = mutation is not None or r.random() < 0.5
    in_dims = {f"a{i}": s for i, s in enumerate(specs) if keep or not (type(s) is int and s == 0)}
    return args, in_dims, mutation, b, r.choice([2, 3, 4])


def one_round(seed: int) -> str | None:
    """Build, plan and run one call; a failure's description, or None when the oracle holds."""
    args, in_dims, mutation, b, n = build(seed)
    specs = tuple(in_dims.get(f"a{i}", 0) for i in range(len(args)))
    steps: list[tuple[str, Callable[[], Any]]] = []
    try:
        dp = dpfast.DataParallel(Identity(len(args)), ["cpu"] * n, in_dims=in_dims, out_dims=specs)
    except DPFAST_ERRORS as exc:
        return _named(seed, "the constructor", exc)
    except Exception as exc:  # noqa: BLE001 - the oracle reports every other exception
        return f"seed {seed}: the constructor raised {type(exc).__name__}: {exc}"[:2000]
    steps = [("plan()", lambda: dp.plan(*args)), ("the call", lambda: dp(*args))]
    results: list[Any] = []
    for what, step in steps:
        try:
            results.append(step())
        except DPFAST_ERRORS as exc:
            results.append(exc)
        except Exception as exc:  # noqa: BLE001
            return f"seed {seed}: {what} raised {type(exc).__name__}: {exc}"[:2000]
    plan, out = results
    if isinstance(plan, Exception) or isinstance(out, Exception):
        if not (isinstance(plan, Exception) and isinstance(out, Exception)):
            return f"seed {seed}: plan() gave {plan!r:.300}, the call {out!r:.300}"
        if (type(plan), str(plan)) != (type(out), str(out)):
            return f"seed {seed}: plan() and the call raised apart: {plan!r} / {out!r}"[:2000]
        return _named(seed, "the call", out)
    if mutation is not None:
        return f"seed {seed}: the mutation {mutation!r} ran without an error"
    why = same(out, tuple(args))
    return None if why is None else f"seed {seed}: not an exact round trip (B = {b}, {plan.sizes}): {why}"[:2000]


def _named(seed: int, where: str, exc: BaseException) -> str | None:
    if names_the_argument(str(exc)):
        return None
    return f"seed {seed}: {where} raised {type(exc).__name__} naming no argument: {exc}"[:2000]


def run(seed: int, rounds: int | None = None, seconds: float | None = None) -> tuple[int, list[str]]:
    """Rounds ``seed, seed + 1, ...`` until ``rounds`` or ``seconds``; ``(rounds run, failures)``."""
    start, k, failures = time.monotonic(), 0, []
    while (rounds is None or k < rounds) and (seconds is None or time.monotonic() - start < seconds):
        failure = one_round(seed + k)
        if failure is not None:
            failures.append(failure)
        k += 1
    return k, failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--seconds", type=float, default=60.0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    n, failures = run(a.seed, a.rounds, None if a.rounds else a.seconds)
    for f in failures[:20]:
        print("[fuzz_structures] FAIL", f)
    print(f"[fuzz_structures] {n} calls from seed {a.seed}: {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
