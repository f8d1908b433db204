"""The standard library's containers in and out: dataclasses (frozen ones, fields without init), typing.NamedTuple,
OrderedDict, defaultdict, their mixtures (a PackedSequence inside a dataclass) and non-tensor leaves, against the
plain module on the CPU rehearsal ``device_ids=["cpu"] * n``; specs given as instances of the same types, and their
errors. User-defined containers are in test_custom_containers.py, PackedSequence in test_packed_sequence.py."""

from __future__ import annotations

import collections
import copy
import dataclasses
import typing

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

import dpfast

from dp_testing import DT

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- dataclasses, NamedTuple, OrderedDict, defaultdict ----------------------------------------------------------


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor  # (F, F), no batch axis
    tag: str = "train"


@dataclasses.dataclass(frozen=True)
class Result:
    y: torch.Tensor
    total: torch.Tensor
    tag: str
    count: int = dataclasses.field(default=0, init=False)


class Point(typing.NamedTuple):
    xy: torch.Tensor
    label: str


class DCModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, b: Batch) -> Result:
        y = self.lin(b.x) @ b.mask
        r = Result(y=y, total=y.sum(), tag=b.tag)
        object.__setattr__(r, "count", 7)
        return r


@pytest.mark.parametrize("in_spec", [{"mask": None}, Batch(x=0, mask=None, tag=None)], ids=["dict", "instance"])
@pytest.mark.parametrize("out_spec", [{"total": "sum"}, Result(y=0, total="sum", tag=None)], ids=["dict", "instance"])
def test_dataclass_in_and_out_round_trip(in_spec, out_spec):
    torch.manual_seed(1)
    module = DCModel().to(DT)
    reference = copy.deepcopy(module)
    x, mask = torch.randn(7, 3, dtype=DT), torch.randn(3, 3, dtype=DT)
    dp = dpfast.DataParallel(module, ["cpu"] * 3, in_dims={"b": in_spec}, out_dims=out_spec)
    out = dp(Batch(x, mask, "hello"))
    ref = reference(Batch(x, mask, "hello"))
    assert type(out) is Result and out.tag == "hello" and out.count == 7
    torch.testing.assert_close(out.y, ref.y)
    torch.testing.assert_close(out.total, ref.total)
    out.total.backward()
    ref.total.backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class Containers(nn.Module):
    def forward(self, p: Point, od: collections.OrderedDict, dd: collections.defaultdict):
        assert type(p) is Point and type(od) is collections.OrderedDict and type(dd) is collections.defaultdict
        assert dd.default_factory is list and list(od) == ["z", "a"]
        return Point(p.xy * 2, p.label), collections.OrderedDict(z=od["z"] + 1, a=od["a"]), dd


def test_namedtuple_ordereddict_defaultdict_in_and_out():
    xy = torch.randn(5, 2)
    od = collections.OrderedDict(z=torch.randn(5), a=torch.randn(5, 3))
    dd = collections.defaultdict(list, {"k": torch.randn(5, 1)})
    out_p, out_od, out_dd = dpfast.DataParallel(Containers(), ["cpu"] * 2)(Point(xy, "pts"), od, dd)
    ref_p, ref_od, ref_dd = Containers()(Point(xy, "pts"), od, dd)
    assert type(out_p) is Point and out_p.label == "pts" and torch.equal(out_p.xy, ref_p.xy)
    assert type(out_od) is collections.OrderedDict and list(out_od) == ["z", "a"]
    assert all(torch.equal(out_od[k], ref_od[k]) for k in ref_od)
    assert type(out_dd) is collections.defaultdict and out_dd.default_factory is list
    assert list(out_dd) == ["k"] and torch.equal(out_dd["k"], dd["k"])
    assert out_dd["missing"] == []  # still a working defaultdict


def test_namedtuple_and_ordereddict_specs():
    xy = torch.randn(4, 2)
    od = collections.OrderedDict(z=torch.randn(4), a=torch.randn(3, 4))
    dd = collections.defaultdict(list, {"k": torch.randn(4, 1)})
    dp = dpfast.DataParallel(
        Containers(),
        ["cpu"] * 2,
        in_dims={"p": Point(0, None), "od": collections.OrderedDict(z=0, a=1)},
        out_dims=(Point(0, None), {"a": 1}, 0),
    )
    _, out_od, _ = dp(Point(xy, "pts"), od, dd)
    assert torch.equal(out_od["a"], od["a"]) and torch.equal(out_od["z"], od["z"] + 1)


# ---- mixed structures and non-tensor leaves ---------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    tokens: PackedSequence
    feats: dict
    meta: dict


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(2, 3)
        self.seen_meta = []

    def forward(self, sample: Sample, table: torch.Tensor, scale: float):
        self.seen_meta.append(sample.meta)
        out, (h, _) = self.lstm(sample.tokens)
        y = sample.feats["dense"][0] * scale + table.sum()
        return {"packed": out, "h": h, "y": [y, sample.feats["dense"][1]], "name": sample.meta["name"]}


def test_mixed_structures_with_packed_sequence_inside_a_dataclass():
    torch.manual_seed(3)
    lengths = [4, 1, 3, 2, 1]
    seqs = [torch.randn(k, 2, dtype=DT) for k in lengths]
    dense = [torch.randn(5, 4, dtype=DT), torch.randn(2, 5, dtype=DT)]
    meta = {"name": "batch-7", "config": object()}
    table = torch.randn(3, 3, dtype=DT)
    module = Mixed().to(DT)
    reference = copy.deepcopy(module)

    def sample():
        return Sample(pack_sequence(seqs, enforce_sorted=False), {"dense": [dense[0], dense[1]]}, meta)

    dp = dpfast.DataParallel(
        module,
        ["cpu"] * 3,
        in_dims={"sample": {"feats": {"dense": [0, 1]}}, "table": None},
        out_dims={"h": 1, "y": [0, 1]},
    )
    out = dp(sample(), table, 2.0)  # 2.0: a float under the default dim passes by reference
    ref = reference(sample(), table, 2.0)
    assert set(out) == {"packed", "h", "y", "name"} and out["name"] == "batch-7"
    torch.testing.assert_close(pad_packed_sequence(out["packed"])[0], pad_packed_sequence(ref["packed"])[0])
    torch.testing.assert_close(out["h"], ref["h"])
    for a, b in zip(out["y"], ref["y"]):
        torch.testing.assert_close(a, b)
    assert len(module.seen_meta) == 3 and all(m is meta for m in module.seen_meta)  # by reference


class Tags(nn.Module):
    def forward(self, x):
        return x, "same", x.shape[0], {"rows": x.shape[0], "kind": "dense"}


def test_non_tensor_outputs_once_when_equal_else_one_per_replica():
    x = torch.randn(7, 2)
    out, tag, n, info = dpfast.DataParallel(Tags(), ["cpu"] * 3)(x)  # chunks [3, 2, 2]
    assert torch.equal(out, x) and tag == "same"
    assert n == [3, 2, 2] and info == {"rows": [3, 2, 2], "kind": "dense"}
    _, _, n, _ = dpfast.DataParallel(Tags(), ["cpu"] * 3)(torch.randn(6, 2))  # chunks [2, 2, 2]: equal, once
    assert n == 2
    _, _, n, _ = dpfast.DataParallel(Tags(), ["cpu"] * 3, out_dims=(0, None, None, None))(x)
    assert n == 3  # None: replica 0's value
    _, _, n, _ = dpfast.DataParallel(Tags(), ["cpu"] * 3, out_dims=(0, None, "sum", None))(x)
    assert n == 7


def test_non_tensors_under_default_dim_pass_by_reference():
    seen = []

    class M(nn.Module):
        def forward(self, x, lengths, mask=None):
            seen.append((lengths, mask))
            return x

    lengths, cfg = [3, 2, 2, 1], {"causal": True}
    dpfast.DataParallel(M(), ["cpu"] * 2)(torch.randn(4, 3), lengths, cfg)
    assert len(seen) == 2 and all(a is lengths and b is cfg for a, b in seen)


# ---- errors -----------------------------------------------------------------------------------------------------


def test_spec_naming_a_field_the_dataclass_lacks():
    dp = dpfast.DataParallel(DCModel(), ["cpu"] * 2, in_dims={"b": {"masks": None}})
    with pytest.raises(
        ValueError,
        match=r"in_dims for `b` names \['masks'\], which `b` does not have; it is a Batch "
        r"with fields \['x', 'mask', 'tag'\]",
    ):
        dp(Batch(torch.randn(4, 3), torch.randn(3, 3)))
    dp = dpfast.DataParallel(DCModel(), ["cpu"] * 2, in_dims={"b": {"mask": None}}, out_dims={"totals": "sum"})
    with pytest.raises(
        ValueError,
        match=r"out_dims for `output` names \['totals'\], which `output` does not have; "
        r"it is a Result with fields \['y', 'total', 'tag', 'count'\]",
    ):
        dp(Batch(torch.randn(4, 3), torch.randn(3, 3)))


def test_dataclass_spec_errors():
    with pytest.raises(TypeError, match=r"in_dims\['b'\].tag is the string 'train'; an in_dims spec is an int"):
        dpfast.DataParallel(DCModel(), ["cpu"] * 2, in_dims={"b": Batch(x=0, mask=None)})
    dp = dpfast.DataParallel(DCModel(), ["cpu"] * 2, in_dims={"b": Result(y=0, total=None, tag=None)})
    with pytest.raises(
        TypeError,
        match=r"in_dims for `b` is a Result instance, but `b` is a Batch with fields "
        r"\['x', 'mask', 'tag'\]; a dataclass spec matches a value of the same "
        r"dataclass",
    ):
        dp(Batch(torch.randn(4, 3), torch.randn(3, 3)))
    dp = dpfast.DataParallel(DCModel(), ["cpu"] * 2, in_dims={"b": {"x": 0}})  # mask under the default dim 0
    with pytest.raises(
        dpfast.ScatterError,
        match=r"(?s)b\.mask .* \(3, 3\).*suggested fix: DataParallel\(\.\.\., "
        r"in_dims=\{'b': \{'mask': None\}\}\)",  # (x under the default dim 0, tag a str it passes whole: no entry)
    ):
        dp(Batch(torch.randn(4, 3), torch.randn(3, 3)))
    net, batch = DCModel(), Batch(torch.randn(4, 3), torch.randn(3, 3))
    got = dpfast.DataParallel(net, ["cpu"] * 2, in_dims={"b": {"mask": None}})(batch)
    torch.testing.assert_close(got.y, net(batch).y)  # the fix runs, as the plain module does
    assert got.tag == batch.tag


def _output_class(kind: str, fields: tuple[str, ...]) -> type:
    if kind == "namedtuple":
        return collections.namedtuple("Output", fields)
    return dataclasses.make_dataclass("Output", [(f, typing.Any) for f in fields])


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass"])
def test_replicas_returning_equal_classes_of_their_own_are_gathered(kind):
    """Was: the first call failed with 'different output structures: replica 0 returned a Output with fields
    ['prediction'], replica 1 returned a Output with fields ['prediction']'."""
    torch.manual_seed(0)

    class PerInstance(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            cls = self.__dict__.get("_output")
            if cls is None or self.__dict__.get("_owner") != id(self):  # a copy builds its own
                cls = self.__dict__["_output"] = _output_class(kind, ("prediction",))
                self.__dict__["_owner"] = id(self)
            return cls(self.lin(x))

    model = PerInstance()
    x = torch.randn(6, 3)
    out = dpfast.DataParallel(model, ["cpu"] * 3)(x)
    assert type(out).__name__ == "Output" and torch.allclose(out.prediction, model(x).prediction)


def test_classes_of_one_name_with_other_fields_still_differ_and_the_message_shows_how():
    class Differs(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x):
            fields = ("prediction",) if x[0, 0] > 0 else ("prediction", "extra")
            return _output_class("namedtuple", fields)(*([self.lin(x)] * len(fields)))

    x = torch.randn(4, 3)
    x[0, 0], x[2, 0] = 1.0, -1.0
    with pytest.raises(
        ValueError,
        match=r"replica 0 returned a Output with fields \['prediction'\], replica 1 "
        r"returned a Output with fields \['prediction', 'extra'\]",
    ):
        dpfast.DataParallel(Differs(), ["cpu"] * 2)(x)
