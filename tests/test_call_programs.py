"""Calls planned by their program (dpfast.plan.program, dpfast.move.gather.GatherProgram): a call whose key
(structure and leaf facts, by value) was seen before is planned and gathered by the program its first call made,
and must do exactly what a fresh wrapper does with it. Nothing kept may ever serve a stale plan: a changed shape,
dtype, device, structure, spec or module is planned as a fresh wrapper plans it."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import assert_bitexact, assert_same_bits


class Echo(nn.Module):
    """Returns what it was given (positional arguments, then keywords), computing nothing."""

    def forward(self, *args, **kwargs):
        return (args, kwargs) if kwargs else args


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x, h=None, *, mask=None):
        out = {"y": x * self.w}
        if h is not None:
            out["h"] = h * self.w
        if mask is not None:
            out["mask"] = mask
        return out


def _dp(module=None, n=2, **kw):
    return dpfast.DataParallel(module or Echo(), ["cpu"] * n, **kw)


def _warm(dp, *args, **kwargs):
    """Two calls of one structure: the first compiles its program, the second runs it."""
    for _ in range(2):
        dp(*args, **kwargs)


def _along_skeleton(dp, *args, **kwargs) -> bool:
    """Whether this call is planned by a program an earlier call compiled (nothing is compiled for it)."""
    programs = dp._settings.specs.programs
    before = programs.compiled
    dp.plan(*args, **kwargs)
    return programs.compiled == before


def _outcome(dp, *args, **kwargs):
    """``("ok", output, plan text)`` or ``("raised", type, message)``."""
    try:
        plan = str(dp.plan(*args, **kwargs))
        return ("ok", dp(*args, **kwargs), plan)
    except Exception as exc:  # noqa: BLE001 - compared with a fresh wrapper's
        return ("raised", type(exc), str(exc))


def _like_a_fresh_wrapper(make, warm_args, args, warm_kwargs=None, kwargs=None, kept=True):
    """A wrapper warmed on one structure then called on ``args`` does what a fresh wrapper does with ``args``
    (``kept``: whether the warm structure's program is kept; the test is worth most where it is)."""
    warm_kwargs, kwargs = warm_kwargs or {}, kwargs or {}
    dp = make()
    _warm(dp, *warm_args, **warm_kwargs)
    assert _along_skeleton(dp, *warm_args, **warm_kwargs) is kept
    got, want = _outcome(dp, *args, **kwargs), _outcome(make(), *args, **kwargs)
    assert got[0] == want[0], (got, want)
    if got[0] == "ok":
        assert_same_bits(got[1], want[1])
        assert got[2] == want[2]
    else:
        assert got[1:] == want[1:]
    return got


def _tensors(n, shape=(8, 2), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


# ---- the fast path does what the full walk does -----------------------------------------------------------------


def test_a_repeated_structure_is_planned_by_its_program():
    value = _tensors(50)
    dp = _dp()
    _warm(dp, value)
    assert _along_skeleton(dp, value)
    plan = dp.plan(value)
    fresh = _dp()
    assert str(plan) == str(fresh.plan(value))
    assert [(m.path, m.axis, m.size) for m in plan.mapped] == [
        (m.path, m.axis, m.size) for m in fresh.plan(value).mapped
    ]
    assert_same_bits(dp(value), fresh(value))


def test_a_kept_plans_sizes_are_its_own():
    """The split of a kept structure is remembered per ``B``: a plan's ``sizes`` changed by its reader must not
    reach the next call's plan."""
    dp, x = _dp(n=3), torch.randn(7, 2)
    _warm(dp, x)
    assert _along_skeleton(dp, x)
    plan = dp.plan(x)
    assert plan.sizes == [3, 2, 2]
    plan.sizes[0] = 99
    again = dp.plan(x)
    assert again.sizes == [3, 2, 2] and again.sizes is not plan.sizes
    assert_same_bits(dp(x), (x,))


def test_mixed_leaves_and_keywords_by_the_program():
    x, h, mask = torch.randn(6, 3, dtype=torch.float64), torch.randn(2, 6, 4, dtype=torch.float64), torch.ones(6, 6)
    make = lambda: _dp(Scale(), in_dims={"h": 1, "mask": None}, out_dims={"h": 1, "mask": None})  # noqa: E731
    _like_a_fresh_wrapper(make, (x, h), (x, h), {"mask": mask}, {"mask": mask})
    ids = list(range(6))  # atoms reach every replica by reference, and come back once
    _like_a_fresh_wrapper(lambda: _dp(), (x, ids, None, "tag"), (x, ids, None, "tag"))


def test_gradients_by_the_program():
    def run(dp):
        x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        h = torch.randn(2, 8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
        out = dp(x, h)
        (out["y"].sin().sum() + out["h"].cos().sum()).backward()
        return x.grad, h.grad, dp.module.w.grad

    warm = _dp(Scale(), in_dims={"h": 1}, out_dims={"h": 1})
    _warm(warm, torch.randn(8, 3, dtype=torch.float64), torch.randn(2, 8, 3, dtype=torch.float64))
    warm.module.w.grad = None
    got, want = run(warm), run(_dp(Scale(), in_dims={"h": 1}, out_dims={"h": 1}))
    for a, b in zip(got, want):
        assert_bitexact(a, b)


# ---- nothing stale: each change is planned afresh -----------------------------------------------------------------

CHANGES = {
    "batch size": (_tensors(4), _tensors(4, (6, 2))),
    "another axis's size": (_tensors(4), _tensors(4, (8, 3))),
    "one leaf's batch": (_tensors(4), _tensors(3) + [torch.randn(7, 2)]),
    "a 0-dim leaf": (_tensors(4), _tensors(3) + [torch.tensor(1.0)]),
    "B smaller than the devices": (_tensors(4), _tensors(4, (1, 2))),
    "B = 0": (_tensors(4), _tensors(4, (0, 2))),
    "dtype": (_tensors(4), _tensors(4, dtype=torch.int64)),
    "bool dtype": (_tensors(4), _tensors(4, dtype=torch.bool)),
    "non-contiguous": (_tensors(4), [t.t() for t in _tensors(4, (2, 8))]),
    "channels_last": ([torch.randn(4, 3, 2, 2)], [torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)]),
    "meta device": (_tensors(4), _tensors(3) + [torch.empty(8, 2, device="meta")]),
    "sparse layout": (_tensors(4), _tensors(3) + [torch.randn(8, 2).to_sparse()]),
    "quantized": (
        _tensors(4),
        _tensors(3) + [torch.quantize_per_tensor(torch.randn(8, 2), 0.1, 0, torch.qint8)],
    ),
    "a Parameter leaf": (_tensors(4), _tensors(3) + [nn.Parameter(torch.randn(8, 2))]),
    "list length": (_tensors(4), _tensors(5)),
    "list to tuple": (_tensors(4), tuple(_tensors(4))),
    "tensor to None": (_tensors(4), _tensors(3) + [None]),
    "tensor to an int": (_tensors(4), _tensors(3) + [3]),
    "tensor to a list": (_tensors(4), _tensors(3) + [_tensors(2)]),
    "deeper": (_tensors(4), [_tensors(4)]),
    "dict keys": ({"a": torch.randn(8, 2), "b": torch.randn(8, 2)}, {"b": torch.randn(8, 2), "a": torch.randn(8, 2)}),
    "dict key type": ({1: torch.randn(8, 2)}, {True: torch.randn(8, 2)}),
    "dict to a mapping": ({"a": torch.randn(8, 2)}, __import__("collections").OrderedDict(a=torch.randn(8, 2))),
    "atoms to a tensor among them": ([torch.randn(8, 2), [1, 2, 3]], [torch.randn(8, 2), [1, torch.ones(8), 3]]),
    "an atom's type": ([torch.randn(8, 2), 1], [torch.randn(8, 2), 1.0]),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_argument_is_planned_afresh(change):
    before, after = CHANGES[change]
    _like_a_fresh_wrapper(lambda: _dp(n=3), (before,), (after,))


@pytest.mark.parametrize(
    "before, after",
    [((torch.randn(8, 2),), (torch.randn(8, 2), torch.randn(8, 2))), ((torch.randn(8, 2),), ())],
    ids=["another argument", "no argument"],
)
def test_a_changed_argument_count_is_planned_afresh(before, after):
    _like_a_fresh_wrapper(lambda: _dp(), before, after)


def test_changed_keywords_are_planned_afresh():
    x = torch.randn(6, 3, dtype=torch.float64)
    make = lambda: _dp(Scale(), in_dims={"mask": None}, out_dims={"mask": None})  # noqa: E731
    _like_a_fresh_wrapper(make, (x,), (x,), {"mask": torch.ones(6, 6)}, {})
    _like_a_fresh_wrapper(make, (x,), (x, torch.randn(6, 3, dtype=torch.float64)), {"mask": torch.ones(6, 6)}, {})


@pytest.mark.parametrize(
    "name, value",
    [
        ("dim", 1),
        ("in_dims", 1),
        ("in_dims", [None]),
        ("chunk_sizes", [1, 3]),
        ("out_dims", 1),
        ("device_ids", ["cpu"]),
    ],
)
def test_a_changed_setting_is_planned_afresh(name, value):
    value_in = [torch.randn(8, 8) for _ in range(3)]
    dp = _dp()
    _warm(dp, value_in)
    setattr(dp, name, value)
    fresh = _dp(**{name: value}) if name != "device_ids" else dpfast.DataParallel(Echo(), ["cpu"])
    assert str(dp.plan(value_in)) == str(fresh.plan(value_in))
    assert_same_bits(dp(value_in), fresh(value_in))


def test_a_spec_changed_in_place_is_planned_afresh():
    x, h = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, 3, dtype=torch.float64)
    in_dims = {"h": 0}
    dp = _dp(Scale(), in_dims=in_dims, out_dims={"h": 0})
    _warm(dp, x, h)
    assert _along_skeleton(dp, x, h)
    in_dims["h"] = 1
    dp.out_dims["h"] = 1
    fresh = _dp(Scale(), in_dims={"h": 1}, out_dims={"h": 1})
    args = (x, h.transpose(0, 1).contiguous())
    assert str(dp.plan(*args)) == str(fresh.plan(*args))
    assert_same_bits(dp(*args), fresh(*args))


def test_a_changed_forward_is_planned_afresh():
    class Two(nn.Module):
        def forward(self, a, b):
            return a, b

    module = Two()
    dp = _dp(module, in_dims={"b": 1}, out_dims=(0, 1))
    a, b = torch.randn(4, 2), torch.randn(3, 4)
    _warm(dp, a, b)
    assert _along_skeleton(dp, a, b)
    module.forward = lambda b, a: (b, a)  # the names now bind the other way round
    with pytest.raises(dpfast.ScatterError):  # `b` (now the first argument) is split along 1: sizes 2 and 3
        dp(a, b)
    args = (a.t(), b.t())  # now `b` (4 along axis 1) comes first
    assert str(dp.plan(*args)) == str(_dp(module, in_dims={"b": 1}, out_dims=(0, 1)).plan(*args))


# ---- outputs ---------------------------------------------------------------------------------------------------


class Switch(nn.Module):
    """Returns what ``self.kind`` says: the output structure changes between calls."""

    def __init__(self):
        super().__init__()
        self.kind = "list"

    def forward(self, x):
        if self.kind == "list":
            return [x, x * 2]
        if self.kind == "dict":
            return {"a": x, "b": x * 2}
        if self.kind == "scalar":
            return [x, x.sum()]  # a 0-dim output is stacked
        if self.kind == "int":
            return [x, 3]
        if self.kind == "ragged":  # replicas return different shapes on another axis
            return [x, torch.zeros(2, x.shape[0] + dpfast.replica_index())]
        if self.kind == "elsewhere":  # the batch on axis 1 of an output gathered along 0
            return [x, torch.zeros(5, x.shape[0])]  # (5 rows: not the chunk sizes)
        return x


@pytest.mark.parametrize("kind", ["dict", "scalar", "int", "ragged", "elsewhere", "tensor"])
def test_changed_outputs_are_gathered_afresh(kind):
    x = torch.randn(6, 3)

    def outcome(module):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = _outcome(_dp(module) if module is not None else None, x)
        return result, [str(w.message) for w in caught]

    module = Switch()
    dp = _dp(module)
    _warm(dp, x)
    module.kind = kind
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _outcome(dp, x)
    fresh = Switch()
    fresh.kind = kind
    with warnings.catch_warnings(record=True) as fresh_caught:
        warnings.simplefilter("always")
        want = _outcome(_dp(fresh), x)
    assert got[0] == want[0]
    if got[0] == "ok":
        assert_same_bits(got[1], want[1])
    else:
        assert got[1:] == want[1:]
    assert [str(w.message) for w in caught] == [str(w.message) for w in fresh_caught]


@pytest.mark.parametrize("kind", ["scalar", "elsewhere"])
def test_kept_outputs_that_need_a_leaf_of_their_own(kind):
    """Outputs of a kept structure that the extension leaves to Python (a 0-dim output, stacked) or that warn are
    combined leaf by leaf, as the full walk combines them, warning every call as it does."""
    module, x = Switch(), torch.randn(6, 3)
    module.kind = kind
    dp = _dp(module)
    for _ in range(4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dp(x)
        fresh = Switch()
        fresh.kind = kind
        with warnings.catch_warnings(record=True) as fresh_caught:
            warnings.simplefilter("always")
            assert_same_bits(out, _dp(fresh)(x))
        assert [str(w.message) for w in caught] == [str(w.message) for w in fresh_caught]
    assert len(dp._settings.outputs) == 1  # (the last calls were gathered by the kept program)


def test_out_dims_changed_in_place_is_gathered_afresh():
    module, x = Switch(), torch.randn(6, 3)
    module.kind = "dict"
    out_dims = {"a": 0, "b": 0}
    dp = _dp(module, out_dims=out_dims)
    _warm(dp, x)
    out_dims["b"] = "sum"
    assert_same_bits(dp(x), _dp(module, out_dims={"a": 0, "b": "sum"})(x))


# ---- what is kept holds no values ----------------------------------------------------------------------------------


def test_a_kept_structure_holds_none_of_the_calls_tensors():
    dp = _dp()
    value = _tensors(10)
    _warm(dp, value)
    out = dp(value)
    assert _along_skeleton(dp, value)
    refs = [weakref.ref(t) for t in value + list(out[0])]
    del value, out
    gc.collect()
    assert all(r() is None for r in refs)


# ---- dict keys: the same key, not an equal one --------------------------------------------------------------------


class _EqualKey:
    """Equal to every other instance, hashed by identity (as a one-element tensor is): equal, yet another key."""

    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, _EqualKey)

    def __hash__(self):
        return id(self)

    def __repr__(self):
        return self.name


def test_tensor_keys_are_planned_afresh():
    """Multi-element tensor keys: ``==`` gives a tensor, whose truth value would raise; a key holding them is never
    kept (their structure is compiled at every call)."""
    k1, k2 = torch.tensor([1, 2]), torch.tensor([1, 3])
    x = torch.randn(4, 2)
    _like_a_fresh_wrapper(_dp, ({k1: x},), ({k2: x},), kept=False)


class _Identity(nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize("keys", ["objects", "tensors"])
def test_equal_but_distinct_keys_get_their_own_specs(keys):
    """The walk looks a dict's specs up by hash: a key equal to the kept one is still another key (it must not get
    the kept key's spec: B = 4 instead of 3); such a structure is never kept."""
    a, b = (_EqualKey("a"), _EqualKey("b")) if keys == "objects" else (torch.tensor(1), torch.tensor(1))
    got = _like_a_fresh_wrapper(
        lambda: _dp(_Identity(), in_dims={"x": {a: 1}}),
        ({a: torch.randn(3, 4)},),
        ({b: torch.randn(3, 4)},),
        kept=False,
    )
    assert got[0] == "ok" and got[1][b].shape == (3, 4)


class _KeyedOutput(nn.Module):
    key: object = None

    def forward(self, x):
        return {type(self).key: x}


@pytest.mark.parametrize("keys", ["equal objects", "tensors"])
def test_output_keys_are_gathered_afresh(keys):
    a, b = (_EqualKey("a"), _EqualKey("b")) if keys == "equal objects" else (torch.tensor([1, 2]), torch.tensor([1, 3]))
    module, x = _KeyedOutput(), torch.randn(4, 6)
    _KeyedOutput.key = a
    try:
        dp = _dp(module, out_dims={a: 1} if keys == "equal objects" else 0)
        _warm(dp, x)
        dp(x)
        _KeyedOutput.key = b
        fresh = _dp(_KeyedOutput(), out_dims={a: 1} if keys == "equal objects" else 0)
        assert_same_bits(dp(x), fresh(x))
    finally:
        _KeyedOutput.key = None


def test_out_dims_changed_during_the_call_is_honoured():
    """out_dims mutated in place inside forward: the gather reads the specs of now, as a fresh wrapper does."""

    class Mutates(nn.Module):
        wrapper = None
        flip = False

        def forward(self, x):
            if type(self).flip:
                type(self).wrapper.out_dims["y"] = 1
            return {"y": x}

    def outcome(warm):
        module = Mutates()
        dp = Mutates.wrapper = _dp(module, out_dims={"y": 0})
        Mutates.flip = False
        x = torch.randn(4, 6)
        if warm:
            _warm(dp, x)
            dp(x)
        Mutates.flip = True
        return dp(x)["y"].shape

    assert outcome(warm=True) == outcome(warm=False) == (2, 12)


@pytest.mark.parametrize("keys", ["objects", "tensors"])
def test_a_kept_structure_holds_none_of_the_calls_keys(keys):
    """Dict keys other than plain values are never kept (kept, a call's key objects would stay alive)."""
    dp = _dp(_Identity())
    key = _EqualKey("a") if keys == "objects" else torch.tensor([1, 2])
    for _ in range(3):
        out = dp({key: torch.randn(4, 2)})
    assert list(out) == [key]
    ref = weakref.ref(key)
    del key, out
    gc.collect()
    assert ref() is None


def test_each_memory_format_has_its_program():
    """A channels_last batch and a contiguous one are two keys: each keeps its program, neither replaces the
    other."""
    dp = _dp(_Identity())
    x = torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    _warm(dp, torch.randn(4, 3, 2, 2))
    programs = dp._settings.specs.programs
    assert programs.compiled == 1
    for _ in range(3):
        assert_same_bits(dp(x), x)
        assert_same_bits(dp(torch.ones(4, 3, 2, 2)), torch.ones(4, 3, 2, 2))
    assert programs.compiled == 2
