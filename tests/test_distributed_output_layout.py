"""dpfast.distributed.output_layout: the layout ``gather_outputs=True`` sends one call's outputs by, kept by the
outputs' key and shapes. A kept layout is never served for outputs the full walk would sort otherwise: for every
call, what :class:`ExchangeLayouts` gives is what :func:`sort_outputs` gives, and any change (structure, keys, a
leaf's kind, a tensor's size, dtype, requires_grad or device, a tensor subclass) has a layout of its own; a number
under "sum"/"mean" is sent with this call's value. No process group is needed: sorting is this rank's own work."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpfast.distributed.output_layout import ExchangeLayouts, Placement, sort_outputs
from dpfast.trees.flatten import unflatten


def _outputs(kind: int, rows: int, width: int, dtype: torch.dtype, grad: bool, extra: object):
    y = torch.randn(rows, width).to(dtype).requires_grad_(grad and dtype.is_floating_point)
    if kind == 0:
        return y
    if kind == 1:
        return (y, y[:, :1].t())  # the second along axis 0 has 1 row: rows go along its last axis here
    if kind == 2:
        return {"y": y, "aux": None, "loss": y.float().mean(), "tag": extra}
    return [y, {"count": torch.tensor(rows), "y2": y}]


outputs = st.tuples(
    st.integers(0, 3),  # structure
    st.integers(1, 6),  # rows
    st.integers(1, 3),  # width
    st.sampled_from([torch.float32, torch.float64, torch.int64]),
    st.booleans(),  # requires_grad
    st.sampled_from([1, "a", None]),  # an atom beside the tensors (kept as it is)
)


def _spec(out):
    """The out_dims of each structure: keys it does not name use dim 0."""
    if isinstance(out, dict):
        return {"loss": "mean", "tag": None}
    return [0, {"count": "sum"}] if isinstance(out, list) else 0


def _same(got, want):
    """Two sorts of the same outputs: the same layout in every field, the very same tensors and leaf values, and a
    tree that rebuilds the same structure."""
    a, b = got.layout, want.layout
    fields = ("slots", "kinds", "reductions", "axes", "shapes", "dtypes", "devices", "desc", "fp", "n_cat")
    for field in fields + ("tensor_leaves",):
        assert getattr(a, field) == getattr(b, field), field
    assert len(got.tensors) == len(want.tensors)
    for x, y in zip(got.tensors, want.tensors):  # the very tensors (a number: a tensor of its value)
        assert x is y or (x.dim() == 0 and torch.equal(x, y) and x.dtype == y.dtype)
    assert all(x is y for x, y in zip(got.values, want.values)) and len(got.values) == len(want.values)
    assert type(unflatten(got.tdef, got.values)) is type(unflatten(want.tdef, want.values))


@settings(max_examples=80, deadline=None)
@given(st.lists(outputs, min_size=2, max_size=10))
def test_a_kept_layout_sorts_as_the_full_walk(sequence):
    """Over a sequence of outputs (each three times in a row), every sort equals the full walk's, and a repeated
    one is sorted by the kept layout (the very object)."""
    kept, reused = ExchangeLayouts(), 0
    for params in sequence:
        before = None
        for _ in range(3):
            out = _outputs(*params)
            got = kept.sort(out, _spec(out), 0, True)
            _same(got, sort_outputs(out, _spec(out), 0, True))
            if before is not None:
                assert got.layout is before, "outputs like the last ones were sorted again"
                reused += 1
            before = got.layout
    assert reused == 2 * len(sequence)


BASE = (2, 4, 3, torch.float32, False, 1)
CHANGES = {
    "rows": (2, 5, 3, torch.float32, False, 1),
    "width": (2, 4, 2, torch.float32, False, 1),
    "dtype": (2, 4, 3, torch.float64, False, 1),
    "requires_grad": (2, 4, 3, torch.float32, True, 1),
    "structure": (1, 4, 3, torch.float32, False, 1),
    "atom of another type": (2, 4, 3, torch.float32, False, "a"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_change_is_walked_in_full(change):
    kept = ExchangeLayouts()
    out = _outputs(*BASE)
    layout = kept.sort(out, _spec(out), 0, True).layout
    changed = _outputs(*CHANGES[change])
    got = kept.sort(changed, _spec(changed), 0, True)
    assert got.layout is not layout
    _same(got, sort_outputs(changed, _spec(changed), 0, True))


def test_another_device_another_key_or_a_subclass_is_walked_in_full():
    kept = ExchangeLayouts()
    y = torch.randn(4, 3)
    layout = kept.sort({"y": y, "z": y}, 0, 0, False).layout
    for other in (
        {"y": y, "z": y.to("meta")},  # another device: the exchange copies it back there
        {"y": y, "w": y},  # another key
        {"z": y, "y": y},  # the same keys in another order
        {"y": y, "z": torch.nn.Parameter(y)},  # a tensor subclass
        {"y": y, "z": (y,)},  # a leaf became a container
    ):
        got = kept.sort(other, 0, 0, False)
        assert got.layout is not layout, other
        _same(got, sort_outputs(other, 0, 0, False))
        assert kept.sort({"y": y, "z": y}, 0, 0, False).layout is layout


def test_numbers_under_a_reduction_are_sent_with_their_value():
    """A number's value changes from call to call: its layout is kept, and each call sends its own value."""
    kept, layouts = ExchangeLayouts(), set()
    for value in (1.5, 2.5, 3.5):
        got = kept.sort((torch.randn(3, 2), value), (0, "mean"), 0, True)
        layouts.add(id(got.layout))
        assert got.tensors[1].item() == value
    assert len(layouts) == 1
    with pytest.raises(ValueError, match="int64 cannot hold"):  # a kept layout still words a number it cannot send
        for value in (1, 2**70):
            kept.sort((torch.randn(3, 2), value), (0, "sum"), 0, True)


def test_a_placement_puts_each_tensor_after_the_rows_aligned():
    """The payload: the "cat" rows (int64) first, then each tensor at a 16-byte boundary, sized by its rows."""
    got = sort_outputs(
        (torch.randn(5, 3), torch.zeros((), dtype=torch.float64), torch.ones(2, 5)), (0, "sum", 1), 0, True
    )
    place = got.layout.placement((5, 5))
    assert place == Placement([16, 80, 96], [60, 8, 40], [(5, 3), (), (5, 2)], 144)
    assert got.layout.placement((0, 0)).size == 32 and got.layout.own_rows(False) == (0, 0)
    assert got.layout.own_rows(True) == (5, 5)


def test_an_out_dims_edited_in_place_is_walked_again():
    """The kept layout is keyed on a copy of the spec it was sorted by: a spec changed in place is another spec."""
    kept, spec = ExchangeLayouts(), {"a": 0, "b": 0}
    out = {"a": torch.randn(3, 2), "b": torch.randn(3, 2)}
    assert kept.sort(out, spec, 0, True).layout.kinds == ["cat", "cat"]
    spec["b"] = "sum"
    assert kept.sort(out, spec, 0, True).layout.kinds == ["cat", "red"]
    assert kept.sort(out, spec, 1, True).layout is not kept.sort(out, spec, 0, True).layout  # another default dim


@pytest.mark.parametrize(
    "number, reduction, says",
    [(2**70, "sum", "int64"), (-(2**63) - 1, "sum", "int64"), (1 + 2j, "mean", "float64")],
)
def test_a_number_no_tensor_of_its_kind_holds_is_a_value_error_naming_it(number, reduction, says):
    """A ValueError that names the output and says what to return (the exchange reports it on every rank), not
    torch's own conversion error (a RuntimeError on some releases, which no rank reported: the others waited)."""
    with pytest.raises(
        ValueError, match=rf"output `output\[1\]` is .*, which {says} cannot hold: out_dims '{reduction}'"
    ):
        sort_outputs((torch.ones(2, 1), number), (0, reduction), 0, True)
