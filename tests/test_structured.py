"""Structured inputs and outputs: PackedSequence, dataclasses, typing.NamedTuple, OrderedDict, defaultdict
and non-tensor leaves, in and out, against the plain module on the CPU rehearsal ``device_ids=["cpu"] * n``."""

from __future__ import annotations

import collections
import copy
import dataclasses
import typing

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pack_sequence, pad_packed_sequence

import dpfast
import dpfast.move.scatter as transfer

from dp_testing import DT, PackedLSTM

pytestmark = pytest.mark.usefixtures("one_thread")


def _weights(t: torch.Tensor) -> torch.Tensor:
    return torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape).sin()


# ---- PackedSequence through an LSTM -----------------------------------------------------------------------------


def _packed_case(lengths, enforce_sorted, with_state):
    torch.manual_seed(len(lengths))
    seqs = [torch.randn(k, 3, dtype=DT) for k in lengths]
    state = (torch.randn(2, len(lengths), 5, dtype=DT), torch.randn(2, len(lengths), 5, dtype=DT))

    def inputs():
        s = [x.clone().requires_grad_(True) for x in seqs]
        h = tuple(t.clone().requires_grad_(True) for t in state) if with_state else None
        return s, h

    return inputs


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize(
    "lengths, enforce_sorted",
    [
        ([3, 5, 1, 4, 1, 2, 5], False),  # unsorted, with length-1 sequences: chunks [3, 2, 2]
        ([1, 4], False),  # B = 2 < 3 devices: two replicas run
        ([2], False),  # B = 1: one replica
        ([6, 4, 4, 2, 1], True),  # sorted (unsorted_indices is None)
    ],
)
def test_lstm_packed_sequence_matches_plain_module(lengths, enforce_sorted, with_state):
    inputs = _packed_case(lengths, enforce_sorted, with_state)
    module = PackedLSTM().to(DT)
    reference = copy.deepcopy(module)
    dp = dpfast.DataParallel(module, ["cpu"] * 3, in_dims={"hx": 1}, out_dims=(0, 1))

    s1, h1 = inputs()
    s2, h2 = inputs()
    out, (h, c) = dp(pack_sequence(s1, enforce_sorted=enforce_sorted), h1)
    ref_out, (ref_h, ref_c) = reference(pack_sequence(s2, enforce_sorted=enforce_sorted), h2)

    assert isinstance(out, PackedSequence)
    padded, lens = pad_packed_sequence(out)
    ref_padded, ref_lens = pad_packed_sequence(ref_out)
    assert lens.tolist() == ref_lens.tolist() == lengths  # the caller's order
    torch.testing.assert_close(padded, ref_padded)
    torch.testing.assert_close(h, ref_h)  # final state gathered on dim 1, in the caller's order
    torch.testing.assert_close(c, ref_c)

    loss = (padded * _weights(padded)).sum() + (h * _weights(h)).sum() + (c * _weights(c)).sum()
    ref_loss = (
        (ref_padded * _weights(ref_padded)).sum() + (ref_h * _weights(ref_h)).sum() + (ref_c * _weights(ref_c)).sum()
    )
    loss.backward()
    ref_loss.backward()
    for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
    for a, b in zip(s1, s2):
        torch.testing.assert_close(a.grad, b.grad)
    if with_state:
        for a, b in zip(h1, h2):
            torch.testing.assert_close(a.grad, b.grad)


def test_packed_sequence_chunks_are_repacked_per_replica_in_caller_order():
    seen = []

    class Record(nn.Module):
        def forward(self, ps, ids):
            padded, lens = pad_packed_sequence(ps, batch_first=True)
            seen.append((ids.tolist(), lens.tolist(), padded[:, 0, 0].tolist()))
            return ps

    lengths = [2, 5, 1, 3, 1]
    seqs = [torch.full((k, 1), float(i)) for i, k in enumerate(lengths)]
    ps = pack_sequence(seqs, enforce_sorted=False)
    out = dpfast.DataParallel(Record(), ["cpu"] * 3)(ps, torch.arange(5))
    assert sorted(seen) == [([0, 1], [2, 5], [0.0, 1.0]), ([2, 3], [1, 3], [2.0, 3.0]), ([4], [1], [4.0])]
    padded, lens = pad_packed_sequence(out, batch_first=True)
    assert lens.tolist() == lengths
    torch.testing.assert_close(padded, pad_packed_sequence(ps, batch_first=True)[0])


def test_packed_sequence_moves_with_one_fused_call_not_a_loop_per_sequence(monkeypatch):
    calls = collections.Counter()
    for name in ("scatter", "gather"):
        real = getattr(transfer.ops, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(transfer.ops, name, counted)
    lengths = torch.randint(1, 9, (64,)).tolist()
    ps = pack_sequence([torch.randn(k, 2) for k in lengths], enforce_sorted=False)
    out = dpfast.DataParallel(nn.Identity(), ["cpu"] * 3)(ps)
    assert calls == {"scatter": 1, "gather": 1}  # one for all 64 sequences, each way
    torch.testing.assert_close(pad_packed_sequence(out)[0], pad_packed_sequence(ps)[0])


def test_packed_sequence_under_none_is_replicated_and_output_under_none_is_replica_zeros():
    seen = []

    class M(nn.Module):
        def forward(self, x, ps):
            seen.append(ps)
            return x, ps

    ps = pack_sequence([torch.ones(3, 1), torch.ones(1, 1)])
    x, out = dpfast.DataParallel(M(), ["cpu"] * 3, in_dims={"ps": None}, out_dims=(0, None))(torch.zeros(6), ps)
    assert seen == [ps] * 3 and out is ps and x.shape == (6,)


def test_packed_output_from_padded_input():
    class Pack(nn.Module):
        def forward(self, x, lengths):
            return pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)

    x = torch.randn(5, 4, 2)
    lengths = torch.tensor([4, 1, 3, 4, 2])
    out = dpfast.DataParallel(Pack(), ["cpu"] * 2)(x, lengths)
    ref = Pack()(x, lengths)
    for a, b in zip(pad_packed_sequence(out, batch_first=True), pad_packed_sequence(ref, batch_first=True)):
        assert torch.equal(a, b)


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
        r"in_dims=\{'b': \{'x': 0, 'mask': None, 'tag': None\}\}\)",
    ):
        dp(Batch(torch.randn(4, 3), torch.randn(3, 3)))


def test_warns_when_output_batch_is_on_another_axis():
    """Seed 000 without out_dims: an even split concatenates the (L, B, H) state into a wrong shape; say so."""
    import warnings

    import dpfast

    class StateOut(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, h):
            return x * self.w, h * self.w

    dp = dpfast.DataParallel(StateOut(), device_ids=["cpu"] * 4, in_dims={"h": 1})
    x, h = torch.randn(8, 3), torch.randn(1, 8, 5)
    with pytest.warns(UserWarning, match=r"output `output\[1\]`.*axis 1 carries the batch chunk sizes \[2, 2, 2, 2\]"):
        dp(x, h)
    right = dpfast.DataParallel(StateOut(), device_ids=["cpu"] * 4, in_dims={"h": 1}, out_dims=(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = right(x, h)
    assert out[1].shape == h.shape
