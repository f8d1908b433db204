"""A seeded fuzzer of the extension's CPython argument parsing: hostile objects inside legal-looking arguments.

Each round takes one private entry point of ``dpfast._C`` or ``dpfast._C_hooks`` (the cost arithmetic, the kernel-
walk hooks, the ops' fast path, the entry points of many leaves, the replicas' dict checks) with valid arguments,
then hides a hostile object in one of them: an int whose ``__index__`` empties, shrinks or grows the list it sits in
(or every list of the call), raises, or returns a number past int64; an object whose ``__class__`` claims to be a
Tensor; a list subclass whose ``__iter__`` and ``__len__`` lie; for the replicas' dict checks, keys and values whose
``__eq__`` raises, and a value whose ``__del__`` (run when a restore clears its dict) empties the call's lists or
its saved dicts. The oracle: the call gives exactly what the same
call gives with a harmless object in the hostile one's place (the extension reads every list as it was when the call
began), or the error that hook asks for (the exception ``__index__`` raised; a TypeError or ValueError for a number
past int64 or an object that is no Tensor); the ops' fast path and the entry points of many leaves may decline
(NotImplemented, or None from ``_batch_size``: dpfast.ops then goes through torch.ops, planning through Python).
Never a crash: ``make sanitize`` runs it under AddressSanitizer with
PYTHONMALLOC=malloc, where reading a freed object is a report.

    python tests/fuzz_entry_points.py --seconds 20 --seed 0

Exit status 1 on the first disagreement, naming the round to replay it (``--seed S --start R --rounds 1``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any, Callable

import torch

from dpfast.ext import loader

C = loader.C
HOOKS = None
if (loader.RECORD or {}).get("test_hooks"):
    import dpfast._C_hooks as HOOKS


class Boom(Exception):
    pass


class HostileInt:
    """Stands for `value` in a list; its __index__ does `action` to the call's lists first."""

    def __init__(self, value: int, action: str, lists: list[list]):
        self.value, self.action, self.lists = value, action, lists

    def __index__(self) -> int:
        for items in self.lists:
            if self.action == "empty":
                items.clear()
            elif self.action == "shrink":
                del items[len(items) // 2 :]
            elif self.action == "grow":  # reallocates the list's item array
                items.extend(int(str(10**6 + i)) for i in range(4 * len(items) + 64))
        if self.action == "raise":
            raise Boom("raised by __index__")
        return 2**70 if self.action == "huge" else self.value


class NotATensor:
    @property
    def __class__(self):
        return torch.Tensor


class LyingList(list):
    def __iter__(self):
        return iter([])

    def __len__(self):
        return 0


def fresh(values: list[int]) -> list[int]:
    """New int objects (Python caches those up to 256), so emptying a list frees them."""
    return [int(str(v)) for v in values]


def draw_call(r: random.Random) -> tuple[str, Callable, list[Any]]:
    """(name, function, arguments): arguments valid as plain lists of ints and tensors."""
    choices = ["exact_prefix", "balanced_bounds", "split", "scatter", "gather", "gather_many", "batch_size"]
    choices += ["narrow_many", "leaf_facts", "same_dicts", "restore_dicts"]
    if HOOKS is not None:
        choices += ["job_offsets", "replay", "side_streams", "node_streams"]
    name = r.choice(choices)
    if name == "exact_prefix":
        return name, C._exact_prefix, [torch.tensor([float(r.randrange(1000)) for _ in range(r.randrange(1, 50))])]
    if name == "balanced_bounds":
        batch, k = r.randrange(1, 400), r.randrange(1, 40)
        prefix = torch.zeros(batch + 1, 2, dtype=torch.long)
        prefix[:, 1] = torch.arange(batch + 1) * 3
        targets = sorted(r.randrange(batch + 1) for _ in range(k))
        return (
            name,
            C._balanced_bounds,
            [prefix, fresh([300 + r.randrange(99) for _ in range(k)]), fresh(targets), 0, 0, 0, 3 * batch * 400],
        )
    if name in ("same_dicts", "restore_dicts"):
        sizes = [r.randrange(6) for _ in range(r.randrange(8))]
        dicts = [dict(zip([f"k{j}" for j in range(n)], fresh([300 + r.randrange(9) for _ in range(n)]))) for n in sizes]
        if name == "restore_dicts":
            return name, C._restore_dicts, [[dict(d, extra=1) if r.random() < 0.5 else d for d in dicts], dicts]
        keys, values = [tuple(d) for d in dicts], [tuple(d.values()) for d in dicts]
        return name, C._same_dicts, [[dict(d) if r.random() < 0.8 else {} for d in dicts], keys, values]
    x = torch.randn(r.randrange(1, 40), 3)
    if name in ("split", "scatter"):
        cuts = sorted(r.randrange(x.shape[0] + 1) for _ in range(r.randrange(0, 8)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, x.shape[0]])]
        if name == "split":
            return name, C._split_contiguous, [[x, x.clone()], 0, sizes]
        return name, C._scatter, [[x], 0, sizes, [torch.device("cpu")] * len(sizes)]
    if name == "gather":
        return name, C._gather, [[x, x.clone(), x[:1]], 0, torch.device("cpu")]
    leaves = [torch.randn(x.shape[0], r.randrange(1, 4)) for _ in range(r.randrange(1, 12))]
    if name == "gather_many":
        columns = [list(leaves) for _ in range(r.randrange(1, 4))]
        sizes = fresh([x.shape[0] + 300] * len(columns))
        dims = fresh([r.choice([0, 1, -1]) for _ in leaves])
        return name, C._gather_many, [columns, dims, torch.device("cpu"), sizes]
    if name == "batch_size":
        where = sorted(r.sample(range(len(leaves)), r.randrange(1, len(leaves) + 1)))
        return name, C._batch_size, [leaves, fresh(where), fresh([r.choice([0, 1]) for _ in where])]
    if name == "leaf_facts":
        return name, C._leaf_facts, [leaves + [x, x.t(), torch.tensor(1.0), None]]
    if name == "narrow_many":
        start = r.randrange(x.shape[0] + 1)
        rows = fresh([start, r.randrange(x.shape[0] - start + 1)])
        return name, C._narrow_many, [leaves, fresh([r.choice([0, -1]) for _ in leaves]), *rows]
    if name == "job_offsets":
        sizes = [r.randrange(300, 2**20) for _ in range(r.randrange(1, 7))]
        strides = fresh([r.randrange(-(2**20), 2**20) for _ in sizes])
        numel = 1
        for s in sizes:
            numel *= s
        units = fresh([r.randrange(numel) for _ in range(r.randrange(1, 64))])
        return name, HOOKS._job_offsets, [fresh(sizes), strides, list(reversed(strides)), units]
    if name == "replay":
        srcs = [torch.arange(float(300 + r.randrange(99))) for _ in range(r.randrange(1, 16))]
        return name, HOOKS._replay_cuda_copy, [srcs, [torch.empty_like(s) for s in srcs], 300 + r.randrange(9), 32]
    devices = [torch.device(r.choice(["cpu", "cuda", "cuda:0", "cuda:1", "cuda:2"])) for _ in range(r.randrange(1, 9))]
    if name == "side_streams":
        return name, HOOKS._side_stream_devices, [devices, torch.device("cuda:0"), r.randrange(3)]
    return name, HOOKS._node_streams, [devices, list(reversed(devices))]


class Index:
    """A harmless int-like: what a HostileInt stands for, without its side effect."""

    def __init__(self, value: int):
        self.value = value

    def __index__(self) -> int:
        return self.value


def _put(args: list[Any], where: tuple[int, int | None], obj: Any) -> None:
    i, j = where
    if j is None:
        args[i] = obj
    else:
        args[i][j] = obj


def hide(r: random.Random, args: list[Any]) -> tuple[list[Any], list[Any], str, str]:
    """(benign arguments, hostile arguments, what was hidden, its action). The benign call has a harmless object
    where the hostile one hides its hook: the hostile call must give what the benign one gives."""
    benign = [list(a) if isinstance(a, list) else a for a in args]
    lists = [a for a in args if isinstance(a, list)]
    items = [(i, j) for i, a in enumerate(args) if isinstance(a, list) for j in range(len(a))]
    items += [(i, None) for i in range(len(args))]
    value = {w: args[w[0]] if w[1] is None else args[w[0]][w[1]] for w in items}
    ints = [w for w in items if type(value[w]) is int]
    tensors = [w for w in items if isinstance(value[w], torch.Tensor)]
    kinds = ["int"] * 4 * bool(ints) + ["tensor"] * bool(tensors) + ["lying list"] * bool(lists)
    kind = r.choice(kinds)
    if kind == "int":
        action = r.choice(["empty", "empty", "shrink", "grow", "raise", "huge"])
        where = r.choice(ints)
        targets = lists if r.random() < 0.5 or where[1] is None else [args[where[0]]]
        _put(benign, where, Index(value[where]))
        _put(args, where, HostileInt(value[where], action, targets))
        return benign, args, f"an __index__ that does {action!r} at argument {where}", action
    if kind == "tensor":
        where = r.choice(tensors)
        _put(args, where, NotATensor())
        return benign, args, f"an object claiming to be a Tensor at argument {where}", "fake tensor"
    where = r.choice([i for i, a in enumerate(args) if isinstance(a, list)])
    args[where] = LyingList(args[where])
    return benign, args, f"a list subclass whose __iter__ and __len__ lie at argument {where}", "lying list"


class Explosive:
    """A dict key or value whose ``__eq__`` raises: an identity check must never call it."""

    def __eq__(self, other: object) -> bool:
        raise Boom("raised by __eq__")

    __hash__ = object.__hash__


class Finalizer:
    """A value only a live dict holds: clearing that dict runs its ``__del__``, which empties the call's lists
    (``empty lists``) or every saved dict (``empty saved``)."""

    def __init__(self, action: str, args: list[Any]):
        self.action, self.args = action, args

    def __del__(self) -> None:
        if self.action == "empty lists":
            for items in self.args:
                items.clear()
        else:
            for d in self.args[1]:
                d.clear()


def dict_call(r: random.Random, name: str) -> tuple[Callable[[str], tuple], str]:
    """A call of ``name`` on fresh dicts each time it is made (the benign and the hostile call each get their own:
    a restore made by one must not leave the other nothing to do), and the action it is made with. The outcome
    holds the return value and, for ``_restore_dicts``, every live dict's entries afterwards."""
    sizes = [r.randrange(1, 6) for _ in range(r.randrange(1, 8))]
    where = r.randrange(len(sizes))
    if name == "same_dicts":
        action = "explosive"
        drop = [r.random() < 0.2 for _ in sizes]

        def call_same(kind: str) -> tuple:
            dicts = [{f"k{j}": int(str(300 + j)) for j in range(n)} for n in sizes]
            key, value = (Explosive(), Explosive()) if kind == "hostile" else (object(), object())
            dicts[where][key] = value
            keys, values = [tuple(d) for d in dicts], [tuple(d.values()) for d in dicts]
            lives = [{} if gone else dict(d) for d, gone in zip(dicts, drop)]
            return outcome(C._same_dicts, [lives, keys, values])

        return call_same, action
    action = r.choice(["empty lists", "empty saved"])
    extra = [r.random() < 0.5 for _ in sizes]

    def call_restore(kind: str) -> tuple:
        saved = [{f"k{j}": int(str(300 + j)) for j in range(n)} for n in sizes]
        lives = [dict(d, extra=1) if more else dict(d) for d, more in zip(saved, extra)]
        args = [list(lives), list(saved)]
        before = [dict(d) for d in saved]
        lives[where]["doomed"] = Finalizer(action, args) if kind == "hostile" else int(str(301))
        got = outcome(C._restore_dicts, args)
        if got[0] != "ok":
            return got
        if action == "empty saved":  # restored from a saved dict before or after the hostile call emptied it
            fine = all(list(d.items()) in (list(b.items()), list(s.items())) for d, b, s in zip(lives, before, saved))
            return ("ok", got[1], "each live dict holds its saved dict's entries" if fine else [dict(d) for d in lives])
        return ("ok", got[1], [list(d.items()) for d in lives])

    return call_restore, action


def outcome(fn: Callable, args: list[Any]) -> tuple:
    try:
        return ("ok", fn(*args))
    except Exception as e:  # noqa: BLE001 - compared against the benign call's
        return ("error", type(e), str(e))


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# dpfast.ops' entry points: anything unusual goes through torch.ops (or Python's own path) when they decline
FAST_PATH = ("split", "scatter", "gather", "gather_many", "narrow_many", "leaf_facts", "same_dicts", "restore_dicts")


def judge(name: str, action: str, benign: tuple, got: tuple) -> str:
    """'' when the hostile call's outcome is allowed, else why not."""
    if name in FAST_PATH and got[0] == "ok" and got[1] is NotImplemented:
        return ""
    if name == "batch_size" and got[0] == "ok" and got[1] in (None, NotImplemented):  # read by Python
        return ""
    if name == "batch_size" and action == "fake tensor" and got == benign:  # (a leaf it was not asked to read)
        return ""
    if name == "leaf_facts" and action == "fake tensor" and got[0] == "ok":  # (read as no tensor: Python reads it)
        return ""
    if action == "fake tensor":
        return "" if got[:2] == ("error", TypeError) else f"{short(got)} for an object that is no Tensor"
    if action == "raise" and got[:2] == ("error", Boom):
        return ""
    if action == "huge" and got[0] == "error" and got[1] in (TypeError, ValueError):
        return ""
    if benign[0] == got[0] == "ok" and same(benign[1], got[1]):
        return ""
    if benign[0] == got[0] == "error" and benign[1:] == got[1:]:
        return ""
    return f"the call gave {short(got)} where the same call without the hook gives {short(benign)}"


def short(result: tuple) -> str:
    return repr(result[:3])[:300]


def run(seconds: float, seed: int, rounds: int, start_round: int = 0) -> int:
    if C is None:
        print("fuzz_entry_points: dpfast._C is not loaded; nothing to fuzz")
        return 1
    start, i, counts = time.monotonic(), 0, {}
    while (rounds and i < rounds) or (not rounds and time.monotonic() - start < seconds):
        round_no = start_round + i
        i += 1
        r = random.Random(f"{seed}/{round_no}")
        name, fn, args = draw_call(r)
        if name in FAST_PATH and i % 16 == 1:  # now and then: valid arguments must take the fast path itself
            plain = outcome(fn, [list(a) if isinstance(a, list) else a for a in args])
            if plain[0] != "ok" or plain[1] is NotImplemented:
                print(f"FAIL seed {seed} round {round_no}: {name} declined or failed valid arguments: {short(plain)}")
                return 1
        if name in ("same_dicts", "restore_dicts") and r.random() < 0.5:  # Python code run inside the call
            call, action = dict_call(r, name)
            benign_got, got = call("benign"), call("hostile")
            if benign_got != got or (benign_got[0] == "ok" and benign_got[1] is NotImplemented):
                why = f"the call gave {short(got)} where the same call without the hook gives {short(benign_got)}"
                print(f"FAIL seed {seed} round {round_no}: {name} with an {action!r} object in a dict: {why}")
                return 1
            counts[action] = counts.get(action, 0) + 1
            continue
        benign, args, hidden, action = hide(r, args)
        why = judge(name, action, outcome(fn, benign), outcome(fn, args))
        if why:
            print(f"FAIL seed {seed} round {round_no}: {name} with {hidden}: {why}")
            return 1
        counts[action] = counts.get(action, 0) + 1
    print(
        f"fuzz_entry_points: seed {seed}, {i} hostile calls in {time.monotonic() - start:.0f} s, each as the same "
        f"call without the hook ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}); the test hooks "
        f"{'included' if HOOKS is not None else 'NOT built (DPFAST_TEST_HOOKS=1 builds them)'}"
    )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=0, help="run exactly this many rounds (0: until --seconds)")
    p.add_argument("--start", type=int, default=0, help="the first round's number")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    return run(a.seconds, a.seed, a.rounds, a.start)


if __name__ == "__main__":
    sys.exit(main())
