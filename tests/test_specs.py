"""in_dims/out_dims binding to forward's signature, prefix matching to argument trees, and their errors."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch
from torch import nn

import dpfast
from dpfast.trees.binding import Binding, BoundArguments
from dpfast.trees.flatten import flatten, leaf_paths, unflatten

Pair = namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Box:
    x: torch.Tensor
    n: int = 3
    cache: list = dataclasses.field(default_factory=list, init=False)


class Sig(nn.Module):
    def forward(self, x, h, mask=None, *, scale=1.0):
        return x


class VarArgs(nn.Module):
    def forward(self, x, *rest, **extra):
        return x


def _specs_of(module, in_dims, args, kwargs=None, dim=0):
    tree = BoundArguments(Binding(module.forward, in_dims, dim), args, kwargs or {})
    return {leaf.path: (leaf.spec, leaf.explicit) for leaf in tree.leaves}


# ---- the walker ---------------------------------------------------------------------------------------------------


def test_flatten_unflatten_roundtrip():
    box = Box(torch.ones(2))
    box.cache.append(5)
    value = {"p": Pair(torch.zeros(1), [None, (3, "s")]), "box": box, "t": (torch.ones(3),)}
    leaves, tdef = flatten(value)
    assert leaf_paths(tdef, "v") == [
        "v['p'].a",
        "v['p'].b[0]",
        "v['p'].b[1][0]",
        "v['p'].b[1][1]",
        "v['box'].x",
        "v['box'].n",
        "v['box'].cache[0]",
        "v['t'][0]",
    ]
    back = unflatten(tdef, leaves)
    assert type(back["p"]) is Pair and back["p"].b == [None, (3, "s")]
    assert type(back["box"]) is Box and back["box"].cache == [5] and back["box"].n == 3
    assert back["t"][0] is value["t"][0]


def test_packed_sequence_is_a_leaf():
    ps = nn.utils.rnn.pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    leaves, tdef = flatten((ps, 1))
    assert leaves[0] is ps and len(leaves) == 2


# ---- binding in_dims ----------------------------------------------------------------------------------------------


def test_dict_binds_positional_and_keyword_alike():
    m = Sig()
    x, h, mask = torch.zeros(2, 3), torch.zeros(1, 2, 3), torch.zeros(4, 4)
    by_pos = _specs_of(m, {"h": 1, "mask": None}, (x, h, mask))
    by_kw = _specs_of(m, {"h": 1, "mask": None}, (x,), {"h": h, "mask": mask})
    assert by_pos == by_kw == {"x": (0, False), "h": (1, True), "mask": (None, True)}


def test_sequence_binds_to_parameter_names():
    specs = _specs_of(Sig(), [0, 1, None], (torch.zeros(1),), {"mask": torch.zeros(1), "h": torch.zeros(1)})
    assert specs == {"x": (0, True), "mask": (None, True), "h": (1, True)}


def test_int_in_dims_and_dim_are_defaults():
    assert _specs_of(Sig(), 1, (torch.zeros(1), torch.zeros(1))) == {"x": (1, False), "h": (1, False)}
    assert _specs_of(Sig(), None, (torch.zeros(1),), dim=-1) == {"x": (-1, False)}


def test_var_args_and_kwargs():
    m = VarArgs()
    t = torch.zeros(1)
    assert _specs_of(m, [0, 1, None], (t, t, t)) == {"x": (0, True), "rest[0]": (1, True), "rest[1]": (None, True)}
    assert _specs_of(m, {"rest": None}, (t, t, t)) == {
        "x": (0, False),
        "rest[0]": (None, True),
        "rest[1]": (None, True),
    }
    assert _specs_of(m, {"rest": (1, None)}, (t, t, t))["rest[0]"] == (1, True)
    assert _specs_of(m, {"mask": None}, (t,), {"mask": t, "other": t}) == {
        "x": (0, False),
        "mask": (None, True),
        "other": (0, False),
    }
    assert _specs_of(m, {"extra": None}, (t,), {"mask": t}) == {"x": (0, False), "mask": (None, True)}
    with pytest.raises(ValueError, match=r"in_dims\['rest'\] is \(1, None\), but the call passes 3 extra"):
        _specs_of(m, {"rest": (1, None)}, (t, t, t, t))


def test_nested_prefix_specs():
    value = {"ids": torch.zeros(2, 3), "mask": torch.zeros(3, 3)}
    specs = _specs_of(
        Sig(), {"x": {"mask": None}, "h": Pair(0, {"x": 1})}, (value, Pair(torch.zeros(2), Box(torch.zeros(3, 2))))
    )
    assert specs == {
        "x['ids']": (0, False),  # a dict spec may name a subset of keys (or fields); the rest use dim
        "x['mask']": (None, True),
        "h.a": (0, True),
        "h.b.x": (1, True),
        "h.b.n": (0, False),  # Box.cache is an empty list: no leaves
    }


# ---- errors at construction ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (
            dict(in_dims={"hx": 1}),
            TypeError,
            r"in_dims names 'hx', which is not a parameter of Sig.forward\(x, h, mask=None, \*, scale=1.0\); "
            r"known names: x, h, mask, scale",
        ),
        (dict(in_dims=[0, 1, None, 0]), ValueError, r"in_dims has 4 specs but .* takes 3 positional arguments"),
        (dict(in_dims={"h": 1.5}), TypeError, r"in_dims\['h'\] is float 1.5"),
        (dict(in_dims={"h": "mean"}), TypeError, r"in_dims\['h'\] is the string 'mean'"),
        (dict(in_dims={"h": (0, [1, True])}), TypeError, r"in_dims\['h'\]\[1\]\[1\] is bool True"),
        (dict(in_dims={1: 0}), TypeError, r"in_dims keys are forward's parameter names"),
        (dict(in_dims=1.0), TypeError, r"in_dims must be None, an int, a sequence"),
        (dict(out_dims={"y": "avg"}), ValueError, r"out_dims\['y'\] is 'avg', which is not a known reduction"),
        (dict(out_dims=object()), TypeError, r"out_dims is object"),
        (dict(dim="0"), TypeError, r"dim must be an int"),
    ],
)
def test_construction_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        dpfast.DataParallel(Sig(), ["cpu"] * 2, **kwargs)


@pytest.mark.parametrize(
    "device_ids, exc, match",
    [
        ([], ValueError, r"device_ids must be a non-empty sequence"),
        ("cpu", ValueError, r"device_ids must be a non-empty sequence"),
        (["cpu", 1.0], TypeError, r"device_ids\[1\] must be an int"),
        (["cpu", "nope"], ValueError, r"device_ids\[1\] is 'nope', which is not a device"),
        (["meta"], ValueError, r"runs on 'cpu' and CUDA devices"),
    ],
)
def test_bad_device_ids(device_ids, exc, match):
    with pytest.raises(exc, match=match):
        dpfast.DataParallel(Sig(), device_ids)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda():
    with pytest.raises(ValueError, match=r"device_ids\[0\] is 0 but CUDA is not available; use 'cpu'"):
        dpfast.DataParallel(Sig(), [0, 1])
    with pytest.raises(ValueError, match=r"output_device is 'cuda:0' but CUDA is not available"):
        dpfast.DataParallel(Sig(), ["cpu"], output_device="cuda:0")


# ---- errors per call (all before any copy or module call) --------------------------------------------------------


class Boom(nn.Module):
    """Fails the test if it is ever called: the errors below must come before any module call."""

    def forward(self, x, h=None, mask=None):
        raise AssertionError("module called despite a bad input")


@pytest.mark.parametrize(
    "in_dims, args, kwargs, exc, match",
    [
        (
            {"h": (0, 1)},
            (torch.zeros(2, 3), torch.zeros(2, 3)),
            {},
            TypeError,
            r"in_dims for `h` is a tuple of 2 specs, but `h` is a Tensor of shape \(2, 3\)",
        ),
        (
            {"h": (0, 1)},
            (torch.zeros(2, 3), (torch.zeros(2), torch.zeros(1, 2), torch.zeros(2))),
            {},
            ValueError,
            r"in_dims for `h` has 2 specs but `h` is a tuple of length 3",
        ),
        (
            {"h": {"c": 1}},
            (torch.zeros(2, 3), {"h": torch.zeros(2)}),
            {},
            ValueError,
            r"in_dims for `h` names \['c'\], which `h` does not have",
        ),
        (
            {"h": {"c": 1}},
            (torch.zeros(2, 3), [torch.zeros(2)]),
            {},
            TypeError,
            r"in_dims for `h` is a dict with keys \['c'\], but `h` is a list of length 1",
        ),
        (
            {"h": 0},
            (torch.zeros(2, 3), [3, 4]),
            {},
            TypeError,
            r"in_dims gives `h\[0\]` the batch axis 0, but it is an int, not a tensor; pass it as a tensor "
            r"\(e\.g\. torch\.tensor\(\.\.\.\)\) to split it, or give it the spec None",
        ),
        ({"mask": 0}, (torch.zeros(2, 3),), {"mask": "causal"}, TypeError, r"`mask` the batch axis 0, but it is a str"),
        (
            None,
            (torch.zeros(2, 3), torch.tensor(1.0)),
            {},
            dpfast.ScatterError,
            r"h     \(\)      0     -     -     <- 0-dim tensor has no batch axis: replicate it with None",
        ),
        (
            {"h": 2},
            (torch.zeros(2, 3), torch.zeros(2, 3)),
            {},
            dpfast.ScatterError,
            r"h     \(2, 3\)  2     -     -     <- axis 2 out of range for 2 dims; axis 0 has size 2",
        ),
        (
            {"h": -3},
            (torch.zeros(2, 3), torch.zeros(2, 3)),
            {},
            dpfast.ScatterError,
            r"axis -3 out of range for 2 dims",
        ),
        (
            None,
            (torch.zeros(4, 3),),
            {"h": (torch.zeros(1, 4, 2), torch.zeros(1, 4, 2)), "mask": torch.zeros(3, 3)},
            dpfast.ScatterError,
            r"suggested fix: DataParallel\(\.\.\., in_dims=\{'h': 1, 'mask': None\}\)",
        ),
        (
            {"h": {"a": 0}},
            (torch.zeros(4, 3), {"a": torch.zeros(4), "b": torch.zeros(2, 4)}),
            {},
            dpfast.ScatterError,
            r"in_dims=\{'h': \{'b': 1\}\}",  # ('a' under the default dim 0 needs no entry)
        ),
        (
            1,
            (torch.zeros(3, 4), torch.zeros(4, 3)),
            {},
            dpfast.ScatterError,
            r"suggested fix: DataParallel\(\.\.\., dim=1, in_dims=\{'h': 0\}\)",
        ),
    ],
)
def test_call_errors_before_any_call(in_dims, args, kwargs, exc, match):
    dp = dpfast.DataParallel(Boom(), ["cpu"] * 2, in_dims=in_dims)
    with pytest.raises(exc, match=match):
        dp(*args, **kwargs)
    with pytest.raises(exc, match=match):
        dp.plan(*args, **kwargs)


def test_non_tensor_under_default_dim_passes_by_reference():
    seen = []

    class M(nn.Module):
        def forward(self, x, lengths):
            seen.append(lengths)
            return x

    lengths = [3, 1, 2]
    dpfast.DataParallel(M(), ["cpu"] * 3)(torch.zeros(3, 2), lengths)
    assert len(seen) == 3 and all(s is lengths for s in seen)


def test_suggestion_for_var_args_and_no_signature():
    class Fwd(nn.Module):
        def forward(self, *xs):
            return xs[0]

    dp = dpfast.DataParallel(Fwd(), ["cpu"] * 2)
    with pytest.raises(dpfast.ScatterError, match=r"in_dims=\{'xs': \(0, None, 1\)\}"):
        dp(torch.zeros(4), torch.zeros(3), torch.zeros(2, 4))

    class NoSig(nn.Module):
        pass

    m = NoSig()
    m.forward = torch.add  # a builtin: inspect.signature cannot read it
    specs = Binding(m.forward, None, 0)
    assert not specs.has_signature
    with pytest.raises(TypeError, match=r"in_dims is a dict, but the signature of .*add cannot be read"):
        Binding(m.forward, {"input": 0}, 0)
    specs = Binding(m.forward, [0, None], 0)
    tree = BoundArguments(specs, (torch.zeros(1), torch.zeros(1), torch.zeros(1)), {"alpha": 2})
    assert [(lf.path, lf.spec) for lf in tree.leaves] == [
        ("args[0]", 0),
        ("args[1]", None),
        ("args[2]", 0),
        ("kwargs['alpha']", 0),
    ]
    assert specs.suggestion({"args[2]": None}) == "in_dims=[0, None, None]"


def test_in_dims_names_bind_through_torch_compile():
    """torch.compile(model).forward is (*args, **kwargs); names must still bind to the model's own parameters."""
    import dpfast

    class Seq(torch.nn.Module):
        def forward(self, x, h):
            return x, h

    from dpfast.plan.call_plan import plan_call
    from dpfast.trees.binding import Binding, forward_of

    compiled = torch.compile(Seq(), backend="eager")
    plan = plan_call(Binding(forward_of(compiled), {"h": 1}, 0), (torch.zeros(4, 3), torch.zeros(2, 4, 5)), {}, 2)
    assert plan.sizes == [2, 2]  # h passed by position, split along its axis 1
    assert "(2, 2, 5)" in str(plan)
    # (DataParallel binds so too, and refuses to copy a compiled module over several devices: see
    # test_compiled_wrapper.py; one device calls it directly)
    dp = dpfast.DataParallel(compiled, device_ids=["cpu"], in_dims={"h": 1})
    assert dp.plan(torch.zeros(4, 3), torch.zeros(2, 4, 5)).batch_size == 4
