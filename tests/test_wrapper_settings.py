"""A DataParallel's public attributes are read at every call, as torch's DataParallel reads ``self.device_ids``,
``self.dim`` and ``self.output_device``: whatever is assigned after construction (or changed in place) is what the
next call runs with, and an invalid assignment is refused at once, changing nothing."""

from __future__ import annotations

import pickle
import types

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import DT


class Recorder(nn.Module):
    """``mask`` (T, T) has no batch axis."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x, mask=None):
        y = self.lin(x)
        return y if mask is None else y + mask.sum()


def _chunks(dp, x, **kwargs):
    """The chunk sizes of one call (its plan's, which conftest checks the call follows)."""
    plan = dp.plan(x, **kwargs)
    dp(x, **kwargs)
    return [s for _, _, s in plan.replicas]


def _x(*shape):
    return torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(sum(shape)))


def test_dim_assigned_after_construction_splits_and_gathers_on_it():
    """Was: split on the old dim, gathered on the new one (a wrong shape, with only a warning)."""
    m = Recorder().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    x = _x(5, 6, 3)  # (T, B, F): the batch is dim 1
    dp.dim = 1
    out = dp(x)
    torch.testing.assert_close(out, m(x))
    assert dp.plan(x).replicas[0][2] == 2  # B = 6 over 3


def test_device_ids_assigned_or_changed_in_place():
    """Was: the old device count kept running."""
    dp = dpfast.DataParallel(Recorder().to(DT), ["cpu"] * 3)
    x = _x(6, 3)
    assert _chunks(dp, x) == [2, 2, 2]
    dp.device_ids = ["cpu"] * 2
    assert dp.device_ids == [torch.device("cpu")] * 2 and dp.src_device_obj == torch.device("cpu")
    assert _chunks(dp, x) == [3, 3]
    dp.device_ids.append("cpu")  # in place, as torch would read it
    dp.device_ids.append("cpu")
    assert _chunks(dp, x) == [2, 2, 1, 1]
    torch.testing.assert_close(dp(x), dp.module(x))


def test_in_dims_assigned_or_changed_in_place():
    m = Recorder().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 2)
    x, mask = _x(4, 3), _x(4, 4)
    with pytest.raises(dpfast.ScatterError):  # mask (T, T) is split on dim 0 too: T != B
        dp(x, mask=_x(5, 5))
    dp.in_dims = {"mask": None}
    torch.testing.assert_close(dp(x, mask=mask), m(x, mask=mask))
    dp.in_dims["mask"] = 0  # in place: split again
    assert dp.plan(x, mask=mask).replicas[0][2] == 2
    with pytest.raises(dpfast.ScatterError):
        dp(x, mask=_x(5, 5))


def test_a_setting_changed_in_place_inside_a_nested_spec_is_read():
    """A spec holding a container (``{"pair": [0, 0]}``) changed inside it, the outer dict untouched: the next call
    splits on the new axis (the settings' identity check cannot vouch for it; the fingerprint does)."""

    class Pair(nn.Module):
        def forward(self, pair):
            return pair[0] * 1, pair[1] * 1

    dp = dpfast.DataParallel(Pair(), ["cpu"] * 2, in_dims={"pair": [0, 0]}, out_dims=(0, 0))
    a, b = _x(4, 3), _x(4, 6)
    assert [r[2] for r in dp.plan([a, b]).replicas] == [2, 2]
    settings = dp.__dict__["_settings"]
    dp([a, b])
    assert dp.__dict__["_settings"] is settings  # (kept while nothing changed)
    dp.in_dims["pair"][1] = 1  # b (4, 6) is now split on its axis 1: B = 6 for a too, so a no longer fits
    with pytest.raises(dpfast.ScatterError):
        dp([a, b])
    dp.out_dims = (0, 1)
    out = dp([_x(6, 3), b])
    torch.testing.assert_close(out[1], b)


def test_settings_changed_in_place_to_the_same_length_are_read():
    """A flat list or dict changed in place without changing its length (the identity check of what it holds)."""
    m = Recorder().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 2, chunk_sizes=[1, 1])
    x = _x(6, 3)
    assert _chunks(dp, x) == [3, 3]
    dp.chunk_sizes[0] = 2  # in place: 2 : 1
    assert _chunks(dp, x) == [4, 2]
    dp.in_dims = {"mask": None}
    mask = _x(4, 4)
    torch.testing.assert_close(dp(x, mask=mask), m(x, mask=mask))
    del dp.in_dims["mask"]
    dp.in_dims["x"] = 0  # another key, the same length
    with pytest.raises(dpfast.ScatterError):  # mask (4, 4) is split on dim 0 again: 4 != 6
        dp(x, mask=mask)
    settings = dp.__dict__["_settings"]
    dp.device_ids[1] = torch.device("cpu")  # an equal value, another object: the settings are kept
    dp(x)
    assert dp.__dict__["_settings"] is settings


def test_chunk_sizes_out_dims_and_cost_assigned():
    m = Recorder().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    x = _x(6, 3)
    dp.chunk_sizes = [1, 0, 2]
    assert _chunks(dp, x) == [2, 4]
    dp.chunk_sizes = None
    dp.out_dims = "sum"
    torch.testing.assert_close(dp(x), m(x[:2]) + m(x[2:4]) + m(x[4:]))

    class Costed(nn.Module):
        def forward(self, x, lengths):
            return x * 2

    dp = dpfast.DataParallel(Costed(), ["cpu"] * 2)
    lengths = torch.tensor([9, 1, 1, 1])
    assert [s for _, _, s in dp.plan(x[:4], lengths).replicas] == [2, 2]
    dp.cost = "lengths"
    assert [s for _, _, s in dp.plan(x[:4], lengths).replicas] == [1, 3]


@pytest.mark.parametrize(
    ("name", "value", "error", "match"),
    [
        ("dim", "1", TypeError, "dim must be an int"),
        ("in_dims", {"nope": 0}, TypeError, "nope"),
        ("out_dims", "max", ValueError, "out_dims"),
        ("chunk_sizes", [1, 2], ValueError, "chunk_sizes has 2 weights but there are 3 device_ids"),
        ("device_ids", [], ValueError, "non-empty sequence"),
        ("device_ids", ["cpu", "meta"], ValueError, "device_ids\\[1\\]"),
        ("output_device", "cuda:7", ValueError, "output_device"),
        ("cost", 3, TypeError, "cost must be"),
    ],
)
def test_an_invalid_assignment_is_refused_and_changes_nothing(name, value, error, match):
    if name == "output_device" and torch.cuda.device_count() > 7:
        pytest.skip("cuda:7 exists here")
    m = Recorder().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    before = {n: getattr(dp, n) for n in ("dim", "in_dims", "out_dims", "chunk_sizes", "device_ids", "cost")}
    with pytest.raises(error, match=match) as info:
        setattr(dp, name, value)
    assert f"DataParallel.{name} = " in str(info.value)
    assert {n: getattr(dp, n) for n in before} == before
    x = _x(6, 3)
    torch.testing.assert_close(dp(x), m(x))
    assert _chunks(dp, x) == [2, 2, 2]


def test_device_ids_that_no_longer_fit_chunk_sizes_are_refused():
    dp = dpfast.DataParallel(Recorder().to(DT), ["cpu"] * 3, chunk_sizes=[1, 1, 2])
    with pytest.raises(ValueError, match="chunk_sizes has 3 weights but there are 2 device_ids"):
        dp.device_ids = ["cpu"] * 2
    dp.chunk_sizes = None
    dp.device_ids = ["cpu"] * 2
    dp.chunk_sizes = [1, 3]
    assert _chunks(dp, _x(8, 3)) == [2, 6]


def test_a_new_forward_rebinds_in_dims_names():
    """``in_dims`` names bind to ``forward``'s signature: binding another forward (accelerate does) rebinds them."""
    m = Recorder().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 2, in_dims={"mask": None})
    x, mask = _x(4, 3), _x(5, 5)
    dp(x, mask=mask)

    def forward(self, mask, x):  # mask now comes first
        return self.lin(x) + mask.sum()

    m.forward = types.MethodType(forward, m)
    torch.testing.assert_close(dp(mask, x), m(mask, x))


def test_settings_survive_pickling_and_no_derived_state_is_stored():
    dp = dpfast.DataParallel(Recorder().to(DT), ["cpu"] * 3)
    dp.dim = 1
    dp.in_dims = {"mask": None}
    state = dp.__getstate__()
    assert not {"_settings", "_replicas", "_pool", "_specs", "_devices"} & set(state)
    twin = pickle.loads(pickle.dumps(dp))
    assert (twin.dim, twin.in_dims, twin.device_ids) == (1, {"mask": None}, [torch.device("cpu")] * 3)
    x = _x(5, 6, 3)
    torch.testing.assert_close(twin(x), dp(x))
