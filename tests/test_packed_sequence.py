"""PackedSequence in and out of DataParallel: split by sequence (each replica gets its sequences repacked, in the
caller's order), through an LSTM with and without a state against the plain module, moved with one fused call each
way, replicated under the spec None, and as an output made from padded input."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pack_sequence, pad_packed_sequence

import dpfast
import dpfast.move.scatter as transfer

from dp_testing import DT, PackedLSTM, weighted_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _weights(t: torch.Tensor) -> torch.Tensor:
    return torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape).sin()


# ---- through an LSTM ----------------------------------------------------------------------------------------------


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


# ---- split by sequence on 2 and 3 replicas, replicated under None -------------------------------------------------


@pytest.mark.parametrize("n", [2, 3])
def test_packed_sequence_split_by_sequence(n):
    torch.manual_seed(8)
    lengths = [3, 5, 1, 4, 4, 2, 5]
    seqs1 = [torch.randn(k, 3, dtype=DT, requires_grad=True) for k in lengths]
    seqs2 = [s.detach().clone().requires_grad_(True) for s in seqs1]
    module = PackedLSTM().to(DT)
    reference = copy.deepcopy(module)
    dp = dpfast.DataParallel(module, ["cpu"] * n, out_dims=(0, 1))
    out, (h, c) = dp(pack_sequence(seqs1, enforce_sorted=False))
    ref_out, (ref_h, ref_c) = reference(pack_sequence(seqs2, enforce_sorted=False))
    assert isinstance(out, PackedSequence)
    padded, lens = pad_packed_sequence(out)
    ref_padded, ref_lens = pad_packed_sequence(ref_out)
    torch.testing.assert_close(lens, ref_lens)
    torch.testing.assert_close(padded, ref_padded)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(c, ref_c)
    weighted_loss((padded, h, c)).backward()
    weighted_loss((ref_padded, ref_h, ref_c)).backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    for s1, s2 in zip(seqs1, seqs2):
        torch.testing.assert_close(s1.grad, s2.grad)
    assert "packed(B=7" in str(dp.plan(pack_sequence(seqs1, enforce_sorted=False)))


def test_packed_sequence_replicated_under_none():
    seen = []

    class M(nn.Module):
        def forward(self, x, ps):
            seen.append(ps)
            return x

    ps = pack_sequence([torch.ones(2, 1), torch.ones(1, 1)])
    dpfast.DataParallel(M(), ["cpu"] * 2, in_dims={"ps": None})(torch.zeros(4), ps)
    assert seen == [ps, ps]
