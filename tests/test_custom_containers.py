"""Containers beyond the built-ins, in and out, on the CPU rehearsal: any ``collections.abc.Mapping`` (``UserDict``,
read-only mappings), dataclass dict hybrids (an ``OrderedDict`` that is a dataclass and hides its ``None`` fields, as
HF's ``ModelOutput`` does), and types registered with ``torch.utils._pytree``. Real HF objects are in
``test_ecosystem_transformers.py``; these stand-ins need no third-party package."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, MutableMapping

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import dpfast
from dpfast.trees.flatten import flatten, leaf_paths, unflatten

from dp_testing import DT

pytestmark = pytest.mark.usefixtures("one_thread")


class Seen(nn.Module):
    """Records what each replica received; returns a per-sample output from both arguments."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).to(DT)
        self.seen: list = []

    def forward(self, batch, x):
        self.seen.append(batch)
        return self.lin(batch["a"]) + x


def test_user_dict_is_split_like_a_dict_and_keeps_its_type():
    torch.manual_seed(0)
    m = Seen()
    a, x = torch.randn(8, 3, dtype=DT), torch.randn(8, 2, dtype=DT)
    batch = collections.UserDict(a=a)
    out = dpfast.DataParallel(m, ["cpu"] * 4)(batch, x)
    assert out.shape == (8, 2)  # was (32, 2): every replica got the whole UserDict
    torch.testing.assert_close(out, m.lin(a) + x)
    got = m.seen[-4:]
    assert all(type(b) is collections.UserDict for b in got)
    assert sorted(b["a"].shape[0] for b in got) == [2, 2, 2, 2]


class FrozenMap(Mapping):
    """A read-only Mapping with its own constructor signature (no clear/update)."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, k):
        return self._data[k]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


class MapOut(nn.Module):
    def forward(self, batch):
        return FrozenMap({"y": batch["a"] * 2, "n": batch["n"]})


def test_read_only_mapping_in_and_out_keeps_its_type():
    a = torch.arange(10.0).reshape(5, 2)
    dp = dpfast.DataParallel(MapOut(), ["cpu"] * 3, in_dims={"batch": {"n": None}}, out_dims={"n": None})
    out = dp(FrozenMap({"a": a, "n": torch.tensor(7)}))
    assert type(out) is FrozenMap and list(out) == ["y", "n"]
    torch.testing.assert_close(out["y"], a * 2)
    assert out["n"].item() == 7


# ---- dataclass dict hybrids (HF ModelOutput's semantics, reduced) --------------------------------------------------


@dataclasses.dataclass
class Output(collections.OrderedDict):
    """Like transformers' ModelOutput: a dataclass and an OrderedDict whose keys are the fields that are not None."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is not None:
                collections.OrderedDict.__setitem__(self, f.name, v)


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3).to(DT)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return Output(loss=loss, logits=logits)


def test_hybrid_output_with_a_leading_none_field_round_trips():
    torch.manual_seed(0)
    m = Classifier()
    x = torch.randn(9, 4, dtype=DT)
    out = dpfast.DataParallel(m, ["cpu"] * 3)(x)
    assert type(out) is Output
    assert out.logits.shape == (9, 3)  # was (3, 3): replica 0's rows only
    torch.testing.assert_close(out.logits, m.lin(x))
    assert list(out.keys()) == ["logits"] and out.loss is None and out.hidden is None
    assert out["logits"] is out.logits


def test_out_dims_may_name_a_field_that_is_none_in_this_call():
    torch.manual_seed(0)
    m = Classifier()
    x, y = torch.randn(10, 4, dtype=DT), torch.randint(0, 3, (10,))
    dp = dpfast.DataParallel(m, ["cpu"] * 4, out_dims={"loss": "mean"})
    evaluated = dp(x)  # no labels: loss is None (was: ValueError "output does not have ['loss']")
    assert evaluated.loss is None and list(evaluated.keys()) == ["logits"]
    trained = dp(x, y)
    assert list(trained.keys()) == ["loss", "logits"]
    torch.testing.assert_close(trained.loss, nn.functional.cross_entropy(m.lin(x), y))
    with pytest.raises(ValueError, match=r"names \['los'\], which `output` does not have"):
        dpfast.DataParallel(m, ["cpu"] * 2, out_dims={"los": "mean"})(x)


def test_hybrid_input_is_split_by_its_fields():
    x = torch.randn(6, 4, dtype=DT)
    tree = Output(logits=x)
    leaves, tdef = flatten(tree)
    assert leaves[0] is None and leaves[1] is x and leaves[2] is None
    assert leaf_paths(tdef, "o") == ["o.loss", "o.logits", "o.hidden"]
    back = unflatten(tdef, [None, x * 2, None])
    assert type(back) is Output and list(back.keys()) == ["logits"]
    torch.testing.assert_close(back.logits, x * 2)


# ---- torch.utils._pytree registrations ---------------------------------------------------------------------------


class Pair:
    """Not a container dpfast knows; registered with torch's pytree below."""

    def __init__(self, first, second, tag="t"):
        self.first, self.second, self.tag = first, second, tag


pytree.register_pytree_node(
    Pair,
    lambda p: ([p.first, p.second], p.tag),
    lambda values, tag: Pair(values[0], values[1], tag),
    flatten_with_keys_fn=lambda p: (
        [(pytree.GetAttrKey("first"), p.first), (pytree.GetAttrKey("second"), p.second)],
        p.tag,
    ),
    serialized_type_name="tests.test_custom_containers.Pair",
)


class PairModel(nn.Module):
    def forward(self, p):
        return Pair(p.first * 2, p.second * 3, p.tag + "!")


def test_pytree_registered_type_is_a_container_in_and_out():
    first, second = torch.randn(7, 2), torch.randn(3, 7)
    dp = dpfast.DataParallel(PairModel(), ["cpu"] * 3, in_dims={"p": {"second": 1}}, out_dims={"second": 1})
    plan = dp.plan(Pair(first, second))
    assert "p.first" in str(plan) and "p.second" in str(plan)
    out = dp(Pair(first, second))
    assert type(out) is Pair and out.tag == "t!"
    torch.testing.assert_close(out.first, first * 2)
    torch.testing.assert_close(out.second, second * 3)


class DequeModel(nn.Module):
    def forward(self, d, x):
        return collections.deque([d[0] + x, d[1] * 2])


def test_deque_is_walked_through_its_pytree_registration():
    a, b, x = torch.randn(5, 2), torch.randn(5), torch.randn(5, 2)
    out = dpfast.DataParallel(DequeModel(), ["cpu"] * 2)(collections.deque([a, b]), x)
    assert type(out) is collections.deque
    torch.testing.assert_close(out[0], a + x)
    torch.testing.assert_close(out[1], b * 2)


class Store(MutableMapping):
    """A MutableMapping whose shallow copy shares its storage (no __copy__): rebuilding it must not clear it."""

    def __init__(self, items=()):
        self.data_ = dict(items)

    def __getitem__(self, k):
        return self.data_[k]

    def __setitem__(self, k, v):
        self.data_[k] = v

    def __delitem__(self, k):
        del self.data_[k]

    def __iter__(self):
        return iter(self.data_)

    def __len__(self):
        return len(self.data_)


def test_mutable_mapping_input_is_left_as_the_caller_made_it():
    torch.manual_seed(0)
    m = Seen()
    a, x = torch.randn(6, 3, dtype=DT), torch.randn(6, 2, dtype=DT)
    batch = Store({"a": a})
    out = dpfast.DataParallel(m, ["cpu"] * 3)(batch, x)
    assert list(batch) == ["a"] and batch["a"] is a
    torch.testing.assert_close(out, m.lin(a) + x)
    assert all(type(b) is Store and b["a"].shape[0] == 2 for b in m.seen[-3:])
