"""Which size is ``B`` when the mapped tensors disagree (:mod:`dpfast.plan.readings`), and a suggested fix that is
the fix: offered only when planning the call with it gives that ``B``, and never one reading picked where several
could be meant. Sequence-first layouts (torch's ``MultiheadAttention`` and ``Transformer`` with
``batch_first=False``) were read by majority vote, and following the suggestion ran on a wrong split."""

from __future__ import annotations

import ast
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import dpfast


def _error(dp, *args, **kwargs) -> str:
    with pytest.raises(dpfast.ScatterError) as info:
        dp(*args, **kwargs)
    with pytest.raises(dpfast.ScatterError, match=re.escape(str(info.value))):
        dp.plan(*args, **kwargs)  # plan() words it the same
    return str(info.value)


def _offered(message: str) -> list[tuple[int | None, dict]]:
    """``(B, in_dims)`` of every fix the message offers, in its order (B None for a single suggested fix)."""
    found = [(None, m) for m in re.findall(r"suggested fix: DataParallel\(\.\.\., in_dims=(.*)\)$", message, re.M)]
    found += [(int(b), m) for b, m in re.findall(r"^  B = (\d+): DataParallel\(\.\.\., in_dims=(.*?)\)(?: \(|$)",
                                                   message, re.M)]  # fmt: skip
    return [(b, ast.literal_eval(m)) for b, m in found]


def _mha():
    torch.manual_seed(0)
    return nn.MultiheadAttention(8, 2)  # batch_first=False: (L, N, E)


def test_sequence_first_attention_lists_both_readings_and_the_batch_one_is_the_module():
    """Was: B = 6 (key and value outvote the query) and ``{'query': None}``, silently a (16, 10, 8) output."""
    q, k, v = torch.randn(10, 4, 8), torch.randn(6, 4, 8), torch.randn(6, 4, 8)
    message = _error(dpfast.DataParallel(_mha(), ["cpu"] * 2), q, k, v)
    offered = _offered(message)
    assert [b for b, _ in offered] == [4, 6] and "several sizes could be B here" in message
    assert offered[0][1] == {"query": 1, "key": 1, "value": 1}
    fixed = dpfast.DataParallel(_mha(), ["cpu"] * 2, in_dims=offered[0][1], out_dims=(1, 0))
    out, weights = fixed(q, k, v)
    plain_out, _ = _mha()(q, k, v)
    torch.testing.assert_close(out, plain_out)
    assert weights.shape == (4, 10, 6)


def test_a_key_padding_mask_makes_the_batch_reading_the_one_suggested():
    """Was: ``{'query': None, 'key_padding_mask': 1}``."""
    q, k, v = torch.randn(10, 4, 8), torch.randn(6, 4, 8), torch.randn(6, 4, 8)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[0, 4:] = True
    message = _error(dpfast.DataParallel(_mha(), ["cpu"] * 2), q, k, v, key_padding_mask=mask)
    assert "(B = 4, the size that splits the most arguments)" in message
    [(b, fix)] = _offered(message)
    assert fix == {"query": 1, "key": 1, "value": 1}
    out = dpfast.DataParallel(_mha(), ["cpu"] * 2, in_dims=fix, out_dims=(1, 0))(q, k, v, key_padding_mask=mask)[0]
    torch.testing.assert_close(out, _mha()(q, k, v, key_padding_mask=mask)[0])


def test_a_sequence_first_transformer_with_its_masks_gets_the_fix_that_runs():
    """Was: B = T and ``{'src': None}``, which brought back seed 004's own error."""

    def model():
        torch.manual_seed(0)
        return nn.Transformer(8, 2, 1, 1, 16, dropout=0.0)

    src, tgt = torch.randn(10, 4, 8), torch.randn(7, 4, 8)
    masks = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(7)}
    masks["src_key_padding_mask"] = torch.zeros(4, 10, dtype=torch.bool)
    [(_, fix)] = _offered(_error(dpfast.DataParallel(model(), ["cpu"] * 2), src, tgt, **masks))
    assert fix == {"src": 1, "tgt": 1, "tgt_mask": None}
    out = dpfast.DataParallel(model(), ["cpu"] * 2, in_dims=fix, out_dims=1)(src, tgt, **masks)
    torch.testing.assert_close(out, model()(src, tgt, **masks))


def test_the_batch_first_suggestions_stay_as_they_were():
    """An LSTM state beside a batch-first input, and a mask without the batch: one fix, as before."""

    class Step(nn.Module):
        def forward(self, x, h, mask):
            return x

    x, h, mask = torch.randn(4, 3), (torch.randn(1, 4, 2), torch.randn(1, 4, 2)), torch.randn(3, 3)
    assert _offered(_error(dpfast.DataParallel(Step(), ["cpu"] * 2), x, h, mask)) == [(None, {"h": 1, "mask": None})]


class _Many(nn.Module):
    def forward(self, *tensors):
        return tensors[0]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_first_fix_offered_plans_the_true_batch(data):
    """Tensors whose batch is on axis 0 or on axis 1 (of 3 dims), every other size distinct: the first fix
    offered (the only one, or the first listed) plans to the true B; every fix offered plans to its own B."""
    batch = data.draw(st.integers(2, 6), label="B")
    n = data.draw(st.integers(2, 4), label="tensors")
    others = iter(data.draw(st.permutations(range(7, 7 + 2 * n)), label="other sizes"))
    tensors = []
    for i in range(n):
        first = data.draw(st.booleans(), label=f"batch-first {i}")
        shape = (batch, next(others), next(others)) if first else (next(others), batch, next(others))
        tensors.append(torch.zeros(shape))
    if all(t.shape[0] == batch for t in tensors):
        return  # they agree: nothing to suggest
    dp = dpfast.DataParallel(_Many(), ["cpu"] * 2)
    offered = _offered(_error(dp, *tensors))
    assert offered, "no fix offered"
    for k, (b, fix) in enumerate(offered):
        plan = dpfast.DataParallel(_Many(), ["cpu"] * 2, in_dims=fix).plan(*tensors)
        if k == 0:
            assert plan.batch_size == batch
        assert b is None or plan.batch_size == b


def test_the_fix_for_a_field_of_a_dataclass_names_that_field_only():
    """Was: every field of the dataclass spelt out (darts' 8), where ``{'x_in': {'state': 1}}`` suffices."""
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        a: torch.Tensor
        b: torch.Tensor
        c: torch.Tensor
        state: torch.Tensor

    class First(nn.Module):
        def forward(self, x_in):
            return x_in.a

    x = Batch(*[torch.randn(4, 3) for _ in range(3)], state=torch.randn(2, 4, 5))
    [(_, fix)] = _offered(_error(dpfast.DataParallel(First(), ["cpu"] * 2), x))
    assert fix == {"x_in": {"state": 1}}
    out = dpfast.DataParallel(First(), ["cpu"] * 2, in_dims=fix)(x)
    torch.testing.assert_close(out, x.a)


def test_the_fix_for_darts_module_input_names_the_state_only():
    """darts' PLModuleInput (darts 0.48, tried by hand): its unset covariates are None and its stage an Enum.
    Those came back in the fix as ``None`` each (7 entries) though the default passes them whole as it is."""
    import dataclasses
    import enum

    class Stage(enum.Enum):
        PREDICT = "pred"

    @dataclasses.dataclass
    class ModuleInput:
        past_target: torch.Tensor
        past_covariates: torch.Tensor | None = None
        future_covariates: torch.Tensor | None = None
        state: tuple | None = None
        stage: Stage = Stage.PREDICT

    class Rnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(1, 4, num_layers=2, batch_first=True)

        def forward(self, x_in):
            return self.lstm(x_in.past_target, x_in.state)[0]

    torch.manual_seed(0)
    net = Rnn()
    x = ModuleInput(torch.randn(8, 6, 1), state=(torch.randn(2, 8, 4), torch.randn(2, 8, 4)))
    [(_, fix)] = _offered(_error(dpfast.DataParallel(net, ["cpu"] * 2), x))
    assert fix == {"x_in": {"state": 1}}
    torch.testing.assert_close(dpfast.DataParallel(net, ["cpu"] * 2, in_dims=fix)(x), net(x))
