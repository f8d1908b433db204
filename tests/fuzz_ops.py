"""A seeded fuzzer for the fused ops: adversarial but legal-looking arguments on every call path.

Each round draws an op and its arguments (shapes with empty, size-1 and huge zero-stride axes; transposed, sliced,
expanded, overlapping and misaligned views; negated and conjugated views; every dtype; dims, sizes and devices in
and out of range, of odd types, overflowing; meta tensors next to CPU ones; a TorchDispatchMode returning too few
tensors) and runs it through ``dpfast.ops`` (the direct C entry points), the ``torch.ops.dpfast`` path and
``dpfast.reference``. Every path must give the same outcome: byte-identical results, or the same exception type
and message. Results are also checked to be contiguous, fresh (no aliasing of inputs) and, for float inputs that
require grad, to give the reference's gradients.

    python tests/fuzz_ops.py --seconds 60 --seed 0

``make sanitize`` runs it against the AddressSanitizer/UBSan build, where a memory error aborts the run.
Exit status 1 on the first disagreement, with the round's seed to replay it (``--seed S --rounds 1``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dpfast
from dpfast import ops
from dpfast import reference as ref

LIMIT_BYTES = 1 << 22  # results bigger than this are not built (the huge views only reach error paths)
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
SIZES = [0, 1, 1, 2, 3, 4, 5, 7, 16, 33]


class Truncating(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "dpfast" and isinstance(out, (list, tuple)) and len(out) > 0:
            return list(out)[:-1]
        return out


class Gen:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)

    def shape(self, rank: int) -> list[int]:
        return [self.r.choice(SIZES) for _ in range(rank)]

    def values(self, shape, dtype) -> torch.Tensor:
        n = int(np.prod(shape)) if shape else 1
        es = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (n * es,), generator=self.g, dtype=torch.uint8)
        x = (raw & 1).bool() if dtype == torch.bool else raw.view(dtype)
        return x.reshape(shape)

    def tensor(self, shape: list[int], dtype=None) -> torch.Tensor:
        """A tensor of `shape` in a random memory layout (values are random bytes: NaN payloads included)."""
        dtype = dtype or self.r.choice(DTYPES)
        layout = self.r.choice(
            ["contiguous", "contiguous", "permuted", "sliced", "expanded", "offset", "overlap", "math_bit"]
        )
        if layout == "permuted" and len(shape) >= 2:
            perm = list(range(len(shape)))
            self.r.shuffle(perm)
            inv = [perm.index(i) for i in range(len(shape))]
            return self.values([shape[p] for p in perm], dtype).permute(*inv)
        if layout == "sliced" and shape:
            big = self.values([2 * s + 1 for s in shape], dtype)
            return big[tuple(slice(1, 1 + 2 * s, 2) for s in shape)]
        if layout == "expanded" and shape:
            k = self.r.randrange(len(shape))
            small = list(shape)
            small[k] = 1
            return self.values(small, dtype).expand(*shape)
        if layout == "offset":  # an odd element offset into the storage: misaligned for 16-byte units
            n = int(np.prod(shape)) if shape else 1
            return self.values([n + 3], dtype)[3:].reshape(shape) if shape else self.values([4], dtype)[3]
        if layout == "overlap" and shape:  # overlapping rows: a legal input to read from
            strides = [self.r.choice([0, 1, 2]) for _ in shape]
            offset = self.r.randrange(4)
            span = offset + 1 + sum((s - 1) * st for s, st in zip(shape, strides) if s > 0)
            return self.values([span], dtype).as_strided(shape, strides, offset)
        if layout == "math_bit":
            x = self.values(shape, dtype)
            if dtype.is_complex:
                return x.conj()
            if dtype.is_floating_point:
                return torch._neg_view(x)
            return x
        return self.values(shape, dtype)

    def huge(self) -> torch.Tensor:
        """Zero strides make a tensor of 2**62 elements in one byte of memory."""
        n = self.r.choice([2**62, 2**62 + 5, 2**63 - 1, 2**61])
        return torch.zeros(1, dtype=torch.uint8).expand(n)

    def dim(self, rank: int) -> Any:
        c = self.r.random()
        if c < 0.75 and rank > 0:
            return self.r.randrange(-rank, rank)
        return self.r.choice([rank, -rank - 1, 2**63 - 1, -(2**63), True, np.int64(0), 0.0, "0", None, 0])

    def split_sizes(self, total: int, ok: bool) -> Any:
        n = self.r.randrange(0, 6)
        if ok:
            cuts = sorted(self.r.randrange(total + 1) for _ in range(max(n - 1, 0)))
            return [b - a for a, b in zip([0] + cuts, cuts + [total])] if n else ([] if total == 0 else [total])
        return self.r.choice(
            [
                [total + 1],
                [-1, total + 1],
                [2**63 - 1, 2**63 - 1, 5],
                [2**62] * 4,
                [total, 0, 0, -0],
                [float(total)],
                [str(total)],
                [np.int64(total)],
                [True] * min(total, 4),
                total,
                [],
                [2**63 - 1, 1],
            ]
        )

    def device(self) -> Any:
        return self.r.choice(
            ["cpu", "cpu", torch.device("cpu"), "meta", torch.device("meta"), "cpu:0", 1.5, None, "nonsense"]
        )


def outcome(fn: Callable[[], Any]) -> tuple:
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - compared across paths
        return ("error", type(e), str(e))


def flat(result: Any) -> list:
    if isinstance(result, torch.Tensor):
        return [result]
    out = []
    for r in result:
        out.extend(flat(r))
    return out


def as_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same(a: tuple, b: tuple) -> str:
    """'' when the outcomes agree, else what differs."""
    if a[0] != b[0]:
        return f"one raised, one did not: {a[:3]} vs {b[:3]}"
    if a[0] == "error":
        oom = "can't allocate memory"  # the allocator's refusal of a huge result: its byte count may differ
        if a[1] is b[1] is RuntimeError and oom in a[2] and oom in b[2]:
            return ""
        return "" if a[1:] == b[1:] else f"errors differ: {a[1:]} vs {b[1:]}"
    fa, fb = flat(a[1]), flat(b[1])
    if len(fa) != len(fb):
        return f"{len(fa)} vs {len(fb)} outputs"
    for x, y in zip(fa, fb):
        if (x.shape, x.dtype, x.device) != (y.shape, y.dtype, y.device):
            return f"{tuple(x.shape)} {x.dtype} {x.device} vs {tuple(y.shape)} {y.dtype} {y.device}"
        if x.device.type != "meta" and as_bytes(x) != as_bytes(y):
            return f"bytes differ for an output of shape {tuple(x.shape)} {x.dtype}"
        if x.device.type != "meta" and not x.is_contiguous():
            return "a result is not contiguous"
    return ""


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def draw_call(gen: Gen) -> tuple[str, tuple]:
    r = gen.r
    op = r.choice(["transpose01", "split_contiguous", "scatter", "gather"])
    bad = r.random() < 0.35  # aim at the error paths
    if op == "transpose01":
        n = r.randrange(0, 4)
        xs = [gen.tensor(gen.shape(r.randrange(1 if bad else 2, 7))) for _ in range(n)]
        if bad and xs and r.random() < 0.3:
            xs.append(torch.empty(2, 3, device="meta"))
        return op, tuple(xs)
    if op in ("split_contiguous", "scatter"):
        rank = r.randrange(0 if bad else 1, 7)
        shape = gen.shape(rank)
        dim = gen.dim(rank) if bad else (r.randrange(-rank, rank) if rank else 0)
        xs = [gen.tensor(shape)]
        for _ in range(r.randrange(0, 3)):  # more tensors with the same size along dim (any rank, any dtype)
            extra = gen.shape(r.randrange(1, 6))
            if isinstance(dim, int) and not isinstance(dim, bool) and rank and -rank <= dim < rank:
                d = dim % rank
                if d < len(extra):
                    extra[d] = shape[d]
            xs.append(gen.tensor(extra))
        total = (
            shape[dim % rank]
            if (rank and isinstance(dim, int) and not isinstance(dim, bool) and -rank <= dim < rank)
            else 0
        )
        if bad and r.random() < 0.3:
            xs = [gen.huge()]
            dim = 0
            total = xs[0].shape[0]
        if bad and r.random() < 0.2:
            xs.append(torch.empty(shape or [1], device="meta"))
        sizes = gen.split_sizes(total, ok=not bad or r.random() < 0.3)
        if op == "split_contiguous":
            return op, (xs, dim, sizes)
        n = len(sizes) if isinstance(sizes, list) else 1
        devices = [gen.device() if bad else r.choice(["cpu", torch.device("cpu"), "meta"]) for _ in range(n)]
        if bad and r.random() < 0.2:
            devices = devices + ["cpu"]
        return op, (xs, dim, sizes, devices)
    rank = r.randrange(0 if bad else 1, 6)
    shape = gen.shape(rank)
    dim = gen.dim(rank) if bad else (r.randrange(-rank, rank) if rank else 0)
    chunks = []
    for _ in range(r.randrange(0 if bad else 1, 5)):
        s = list(shape)
        if rank and isinstance(dim, int) and not isinstance(dim, bool) and -rank <= dim < rank:
            s[dim % rank] = r.choice(SIZES)
        if bad and r.random() < 0.2 and s:
            s[r.randrange(len(s))] += 1
        dtype = chunks[0].dtype if chunks and (not bad or r.random() < 0.7) else None
        chunks.append(gen.tensor(s, dtype))
    if bad and r.random() < 0.3:
        chunks = [gen.huge() for _ in range(r.randrange(1, 5))]
        dim = 0
    if bad and r.random() < 0.2:
        chunks.append(torch.empty(shape or [1], device="meta"))
    device = gen.device() if bad else r.choice(["cpu", "meta"])
    return op, (chunks, dim, device)


def too_big(op: str, args: tuple) -> bool:
    """Whether a successful call could allocate more than LIMIT_BYTES: then only the error paths are run."""
    tensors = args if op == "transpose01" else args[0]
    return any(isinstance(t, torch.Tensor) and nbytes(t) > LIMIT_BYTES for t in tensors)


def will_error(op: str, args: tuple) -> bool:
    return outcome(lambda: getattr(ref, op)(*args))[0] == "error"


def boxed(op: str, args: tuple) -> Any:
    saved = ops._compiling
    ops._compiling = lambda: True  # the wrapper's torch.ops path, as torch.compile takes it
    try:
        return getattr(ops, op)(*args)
    finally:
        ops._compiling = saved


def check_gradients(op: str, args: tuple) -> str:
    """Float inputs that require grad: the gradients of sum(outputs * weights) agree with the reference's."""
    tensors = list(args) if op == "transpose01" else list(args[0])
    if not tensors or not all(
        isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64) and t.device.type == "cpu"
        for t in tensors
    ):
        return ""
    rest = () if op == "transpose01" else args[1:]
    if op != "transpose01" and any(
        isinstance(d, str) and "meta" in d or getattr(d, "type", "") == "meta"
        for d in (rest[-1] if op == "scatter" else [rest[-1]] if op == "gather" else [])
    ):
        return ""
    grads = []
    for fn in (ops, ref):
        leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
        call_args = tuple(leaves) if op == "transpose01" else (leaves,) + rest
        outs = flat(getattr(fn, op)(*call_args))
        if not outs:
            return ""
        loss = sum((o.double() * (k + 1)).sum() for k, o in enumerate(outs))
        grads.append(torch.autograd.grad(loss, leaves, allow_unused=True))
    for a, b in zip(*grads):
        if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
            return "gradients differ"
    return ""


def run(seconds: float, seed: int, rounds: int, verbose: bool) -> int:
    start = time.monotonic()
    counts = {"rounds": 0, "agreed ok": 0, "agreed error": 0}
    i = 0
    while (rounds and i < rounds) or (not rounds and time.monotonic() - start < seconds):
        round_seed = seed * 1_000_003 + i
        i += 1
        gen = Gen(round_seed)
        op, args = draw_call(gen)
        if too_big(op, args) and not will_error(op, args):
            continue
        counts["rounds"] += 1
        truncate = gen.r.random() < 0.05 and op != "gather"  # gather returns one tensor: nothing to truncate
        results = {}
        for path, fn in (
            ("reference", lambda op=op, args=args: getattr(ref, op)(*args)),
            ("dpfast.ops", lambda op=op, args=args: getattr(ops, op)(*args)),
            ("torch.ops path", lambda op=op, args=args: boxed(op, args)),
        ):
            if truncate and path != "reference":
                with Truncating():
                    results[path] = outcome(fn)
            else:
                results[path] = outcome(fn)
        if truncate:  # too few tensors must be a clean error, never a crash or a short result
            for path in ("dpfast.ops", "torch.ops path"):
                got = results[path]
                expect = results["reference"]
                if expect[0] == "ok" and flat(expect[1]) and not (got[0] == "error" and "were expected" in got[2]):
                    print(f"FAIL seed {round_seed}: {op} under a truncating mode on {path}: {got[:3]}")
                    return 1
            continue
        for path in ("dpfast.ops", "torch.ops path"):
            diff = same(results["reference"], results[path])
            if diff:
                print(f"FAIL seed {round_seed}: {op} on {path}: {diff}\n  args: {describe(args)}")
                return 1
        if results["reference"][0] == "ok":
            counts["agreed ok"] += 1
            diff = check_gradients(op, args)
            if diff:
                print(f"FAIL seed {round_seed}: {op}: {diff}\n  args: {describe(args)}")
                return 1
        else:
            counts["agreed error"] += 1
        if verbose:
            print(round_seed, op, results["reference"][0], results["reference"][1:2])
    print(
        f"fuzz_ops: seed {seed}, {counts['rounds']} calls on 3 paths in {time.monotonic() - start:.0f} s: "
        f"{counts['agreed ok']} identical results, {counts['agreed error']} identical errors; extension "
        f"{'loaded from ' + dpfast.ext.loader.C.__file__ if dpfast.build_info()['extension_loaded'] else 'NOT loaded'}"
    )
    return 0


def describe(args: Any) -> str:
    if isinstance(args, torch.Tensor):
        return (
            f"Tensor{tuple(args.shape)} {args.dtype} {args.device} stride={args.stride()} "
            f"neg={args.is_neg()} conj={args.is_conj()}"
        )
    if isinstance(args, (list, tuple)):
        inner = ", ".join(describe(a) for a in args)
        return f"[{inner}]" if isinstance(args, list) else f"({inner})"
    return repr(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=0, help="run exactly this many rounds (0: until --seconds)")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    return run(a.seconds, a.seed, a.rounds, a.verbose)


if __name__ == "__main__":
    sys.exit(main())
