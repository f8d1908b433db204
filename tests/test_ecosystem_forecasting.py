"""pytorch-forecasting's models under ``dpfast.DataParallel``, as its users call them: a batch dict from a tiny
``TimeSeriesDataSet`` (no downloads), the model's ``Output`` back. Its models build their output class per module
instance, so a fresh model's replicas each returned a class of their own and the first call failed with "different
output structures" (issue 46); they are one structure now, rebuilt with the model's own class. Skipped where
pytorch-forecasting is not installed (the Makefile installs it beside the suite's torch)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import dpfast

pf = pytest.importorskip("pytorch_forecasting")
pd = pytest.importorskip("pandas")

MODELS = {
    "RecurrentNetwork": dict(hidden_size=4, rnn_layers=2, dropout=0.0),
    "DeepAR": dict(hidden_size=4, rnn_layers=2, dropout=0.0),
    "TemporalFusionTransformer": dict(hidden_size=4, attention_head_size=1, hidden_continuous_size=2, dropout=0.0),
}


@pytest.fixture(scope="module")
def dataset():
    n_series, length = 6, 20
    frame = pd.DataFrame(
        {
            "series": np.repeat(np.arange(n_series), length).astype(str),
            "time_idx": np.tile(np.arange(length), n_series),
            "value": np.random.RandomState(0).randn(n_series * length).astype("float32"),
        }
    )
    return pf.TimeSeriesDataSet(
        frame,
        time_idx="time_idx",
        target="value",
        group_ids=["series"],
        max_encoder_length=6,
        max_prediction_length=3,
        time_varying_unknown_reals=["value"],
        static_categoricals=["series"],
    )


def _batch(dataset, size):
    x, _ = next(iter(dataset.to_dataloader(train=False, batch_size=size)))
    return x


def _fields(out):
    return out._asdict() if hasattr(out, "_asdict") else dict(out)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("replicas", [2, 3])
def test_a_fresh_model_first_call_equals_the_plain_model(dataset, name, replicas):
    torch.manual_seed(0)
    model = getattr(pf, name).from_dataset(dataset, **MODELS[name]).eval()
    x = _batch(dataset, 8)
    with torch.no_grad():
        got = dpfast.DataParallel(model, ["cpu"] * replicas)(x)  # the first call, on a fresh model
        want = model(x)
    assert type(got) is type(want)
    got_fields, want_fields = _fields(got), _fields(want)
    assert list(got_fields) == list(want_fields)
    for key, value in want_fields.items():
        for a, b in zip(torch.utils._pytree.tree_leaves(got_fields[key]), torch.utils._pytree.tree_leaves(value)):
            torch.testing.assert_close(a, b, msg=lambda m, key=key: f"{name}.{key}: {m}")


@pytest.mark.parametrize("name", ["RecurrentNetwork", "DeepAR"])
def test_a_training_step_gives_the_plain_model_gradients(dataset, name):
    torch.manual_seed(0)
    model = getattr(pf, name).from_dataset(dataset, **MODELS[name]).double().train()
    plain = copy.deepcopy(model)
    x = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in _batch(dataset, 7).items()}
    dpfast.DataParallel(model, ["cpu"] * 3)(x).prediction.pow(2).mean().backward()
    plain(x).prediction.pow(2).mean().backward()
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        if q.grad is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=n: f"grad of {n}: {m}")
