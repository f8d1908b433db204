"""in_dims keys that ``forward`` accepts only through ``**kwargs`` cannot be checked at construction: a call that does
not pass one (a typo such as ``attention_msk`` on an HF model) warns, once per name."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dpfast


class KwModel(nn.Module):
    def forward(self, x, mask=None, **kwargs):
        return x * 2


def _call_warnings(dp, *args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp(*args, **kwargs)
    return [str(w.message) for w in caught if "in_dims" in str(w.message)]


def test_key_bound_only_through_kwargs_and_missing_from_the_call_warns_once():
    dp = dpfast.DataParallel(KwModel(), ["cpu"] * 2, in_dims={"attention_msk": None})
    x = torch.randn(4, 3)
    first = _call_warnings(dp, x, attention_mask=torch.ones(4, 3))
    assert len(first) == 1
    assert "in_dims names 'attention_msk'" in first[0]
    assert "only through **kwargs" in first[0] and "attention_mask" in first[0]  # the call's keywords, to spot typos
    assert _call_warnings(dp, x, attention_mask=torch.ones(4, 3)) == []  # once per name


def test_no_warning_when_the_key_is_passed_or_is_a_declared_parameter():
    dp = dpfast.DataParallel(KwModel(), ["cpu"] * 2, in_dims={"extra": None, "mask": None})
    x = torch.randn(4, 3)
    assert _call_warnings(dp, x, extra=torch.ones(3)) == []
    assert _call_warnings(dp, x, extra=torch.ones(3)) == []


def test_keys_of_a_spec_for_kwargs_itself_warn_too():
    dp = dpfast.DataParallel(KwModel(), ["cpu"] * 2, in_dims={"kwargs": {"token_types": 1}})
    caught = _call_warnings(dp, torch.randn(4, 3))
    assert len(caught) == 1 and "in_dims names 'token_types'" in caught[0]


@pytest.mark.parametrize("where", ["plan", "call"])
def test_plan_warns_as_the_call_does(where):
    dp = dpfast.DataParallel(KwModel(), ["cpu"] * 2, in_dims={"typo": None})
    with pytest.warns(UserWarning, match="in_dims names 'typo'"):
        if where == "plan":
            dp.plan(torch.randn(4, 3))
        else:
            dp(torch.randn(4, 3))
