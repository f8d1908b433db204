"""The bad-argument tables: every invalid DataParallel constructor argument, and every call argument that does not
fit its spec, the batch or the devices, raises a clear error naming the argument, before the module runs; plan()
refuses the same call arguments the same way. Output specs are checked when the outputs exist, naming the output."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

import dpfast

from dp_testing import Counting

pytestmark = pytest.mark.usefixtures("one_thread")

# ---- the constructor ----------------------------------------------------------------------------------------------


def _ctor(**kw):
    module = kw.pop("module", None) or Counting()
    kw.setdefault("device_ids", ["cpu"] * 2)
    return dpfast.DataParallel(module, **kw)


NAN = float("nan")
CTOR_ROWS = [
    # (id, constructor kwargs, exception, regex)
    ("module-not-a-module", {"module": lambda x: x}, TypeError, r"module must be a torch\.nn\.Module, got function"),
    ("device_ids-str", {"device_ids": "cpu"}, ValueError, r"device_ids must be a non-empty sequence"),
    ("device_ids-int", {"device_ids": 3}, ValueError, r"device_ids must be a non-empty sequence"),
    ("device_ids-empty", {"device_ids": []}, ValueError, r"device_ids must be a non-empty sequence .* got \[\]"),
    ("device_ids-object", {"device_ids": object()}, TypeError, r"device_ids must be a non-empty sequence"),
    ("device_ids-None-entry", {"device_ids": ["cpu", None]}, TypeError, r"device_ids\[1\] must be an int"),
    ("device_ids-bool-entry", {"device_ids": [True]}, TypeError, r"device_ids\[0\] must be an int"),
    ("device_ids-bad-name", {"device_ids": ["cpu", "gpu"]}, ValueError, r"device_ids\[1\] is 'gpu', which is not a "),
    ("device_ids-negative", {"device_ids": [-1]}, ValueError, r"device_ids\[0\] is -1"),
    (
        "device_ids-meta",
        {"device_ids": ["meta"]},
        ValueError,
        r"device_ids\[0\] is 'meta'; dpfast\.DataParallel "
        r"runs on 'cpu' and CUDA devices",
    ),
    (
        "device_ids-mixed",
        {"device_ids": ["cpu", "cuda:0"]},
        ValueError,
        r"device_ids\[1\] is 'cuda:0' but CUDA is not available|device_ids mix device types",
    ),
    ("output_device-bad-name", {"output_device": "x"}, ValueError, r"output_device is 'x', which is not a device"),
    ("output_device-float", {"output_device": 1.5}, TypeError, r"output_device must be an int"),
    ("dim-str", {"dim": "0"}, TypeError, r"dim must be an int \(the batch axis\), got str '0'"),
    ("dim-float", {"dim": 1.0}, TypeError, r"dim must be an int"),
    ("dim-bool", {"dim": True}, TypeError, r"dim must be an int"),
    ("in_dims-bool", {"in_dims": True}, TypeError, r"in_dims must be None, an int, a sequence"),
    ("in_dims-float", {"in_dims": 0.5}, TypeError, r"in_dims must be None, an int, a sequence"),
    ("in_dims-set", {"in_dims": {0}}, TypeError, r"in_dims must be None, an int, a sequence"),
    (
        "in_dims-unknown-name",
        {"in_dims": {"y": 0}},
        TypeError,
        r"in_dims names 'y', which is not a parameter of "
        r"Counting\.forward\(x, lengths=None, mask=None\)",
    ),
    ("in_dims-non-str-key", {"in_dims": {1: 0}}, TypeError, r"in_dims keys are forward's parameter names"),
    ("in_dims-too-many", {"in_dims": (0, 0, 0, 0)}, ValueError, r"in_dims has 4 specs but .* takes 3 positional"),
    ("in_dims-reduction", {"in_dims": {"x": "sum"}}, TypeError, r"in_dims\['x'\] is the string 'sum'"),
    ("in_dims-float-leaf", {"in_dims": {"x": (0, 1.5)}}, TypeError, r"in_dims\['x'\]\[1\] is float 1\.5"),
    ("out_dims-unknown-reduction", {"out_dims": "max"}, ValueError, r"out_dims is 'max', which is not a known "),
    ("out_dims-float", {"out_dims": 1.0}, TypeError, r"out_dims is float 1\.0"),
    ("out_dims-nested-object", {"out_dims": (0, {"a": object()})}, TypeError, r"out_dims\[1\]\['a'\] is object"),
    ("chunk_sizes-str", {"chunk_sizes": "12"}, TypeError, r"chunk_sizes must be a sequence of relative weights"),
    ("chunk_sizes-length", {"chunk_sizes": [1]}, ValueError, r"chunk_sizes has 1 weights but there are 2 device_ids"),
    ("chunk_sizes-negative", {"chunk_sizes": [1, -1]}, ValueError, r"chunk_sizes\[1\] is -1; weights must be >= 0"),
    ("chunk_sizes-nan", {"chunk_sizes": [1, NAN]}, ValueError, r"chunk_sizes\[1\] is nan; weights must be finite"),
    ("chunk_sizes-inf", {"chunk_sizes": [math.inf, 1]}, ValueError, r"chunk_sizes\[0\] is inf"),
    ("chunk_sizes-zero", {"chunk_sizes": [0, 0]}, ValueError, r"chunk_sizes \[0, 0\] are all zero"),
    ("chunk_sizes-bool", {"chunk_sizes": [1, True]}, TypeError, r"chunk_sizes\[1\] is bool True"),
    ("chunk_sizes-str-entry", {"chunk_sizes": [1, "2"]}, TypeError, r"chunk_sizes\[1\] is str '2'"),
]


@pytest.mark.parametrize("kwargs, exc, pattern", [r[1:] for r in CTOR_ROWS], ids=[r[0] for r in CTOR_ROWS])
def test_bad_constructor_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        _ctor(**kwargs)


# ---- the call -----------------------------------------------------------------------------------------------------


def _x(*shape):
    return torch.randn(*shape)


CALL_ROWS = [
    # (id, in_dims, args, kwargs, exception, regex naming the argument)
    (
        "spec-tuple-for-tensor",
        {"x": (0, 1)},
        (_x(4, 3),),
        {},
        TypeError,
        r"in_dims for `x` is a tuple of 2 specs, but `x` is a Tensor of shape \(4, 3\)",
    ),
    (
        "spec-length-mismatch",
        {"x": (0, 1)},
        ((_x(4), _x(4), _x(4)),),
        {},
        ValueError,
        r"in_dims for `x` has 2 specs but `x` is a tuple of length 3",
    ),
    (
        "spec-dict-for-list",
        {"mask": {"a": 0}},
        (_x(4, 3),),
        {"mask": [_x(4)]},
        TypeError,
        r"in_dims for `mask` is a dict with keys \['a'\], but `mask` is a list of length 1",
    ),
    (
        "spec-unknown-key",
        {"mask": {"b": 0}},
        (_x(4, 3),),
        {"mask": {"a": _x(4)}},
        ValueError,
        r"in_dims for `mask` names \['b'\], which `mask` does not have",
    ),
    ("dim-out-of-range", {"x": 2}, (_x(4, 3),), {}, dpfast.ScatterError, r"x .* axis 2 out of range for 2 dims"),
    (
        "negative-dim-out-of-range",
        {"mask": -3},
        (_x(4, 3),),
        {"mask": _x(4, 3)},
        dpfast.ScatterError,
        r"mask .* axis -3 out of range for 2 dims",
    ),
    (
        "0-dim-under-default",
        None,
        (_x(4, 3), None, torch.tensor(1.0)),
        {},
        dpfast.ScatterError,
        r"mask .*0-dim tensor has no batch axis: replicate it with None",
    ),
    (
        "0-dim-under-explicit",
        {"mask": 0},
        (_x(4, 3),),
        {"mask": torch.tensor(1.0)},
        dpfast.ScatterError,
        r"(?s)mask .*0-dim tensor has no batch axis.*in_dims=\{'mask': None\}",
    ),
    (
        "list-under-explicit-int",
        {"lengths": 0},
        (_x(4, 3), [3, 2, 2, 1]),
        {},
        TypeError,
        r"in_dims gives `lengths\[0\]` the batch axis 0, but it is an int, not a tensor; pass it as a tensor "
        r"\(e\.g\. torch\.tensor\(\.\.\.\)\) to split it, or give it the spec None",
    ),
    (
        "str-under-explicit-int",
        {"mask": 0},
        (_x(4, 3),),
        {"mask": "causal"},
        TypeError,
        r"`mask` the batch axis 0, but it is a str",
    ),
    (
        "batch-mismatch",
        None,
        (_x(4, 3), _x(5, 3)),
        {},
        dpfast.ScatterError,
        r"(?s)B = 4.*lengths +\(5, 3\) +0 +0 +5 +<- expected 4; no axis has size 4.*in_dims=\{'lengths': None\}",
    ),
    (
        "batch-mismatch-on-axis-1",
        None,
        (_x(4, 3),),
        {"mask": _x(2, 4)},
        dpfast.ScatterError,
        r"(?s)mask +\(2, 4\) .*<- expected 4; axis 1 has size 4.*in_dims=\{'mask': 1\}",
    ),
    (
        "packed-mismatch",
        None,
        (_x(4, 3), pack_sequence([_x(2, 1), _x(1, 1)])),
        {},
        dpfast.ScatterError,
        r"lengths +packed\(B=2",
    ),
    (
        "generator-under-the-default",
        None,
        (_x(4, 3), (n for n in range(4))),
        {},
        TypeError,
        r"`lengths` is a generator, a one-shot iterator: every replica would be handed the same one.*list\(",
    ),
    (
        "generator-replicated",
        {"lengths": None},
        (_x(4, 3), (n for n in range(4))),
        {},
        TypeError,
        r"`lengths` is a generator, a one-shot iterator",
    ),
    (
        "generator-as-items",
        {"lengths": "items"},
        (_x(4, 3), (n for n in range(4))),
        {},
        TypeError,
        r"in_dims for `lengths` is 'items', but `lengths` is a generator; 'items' is for a list or tuple",
    ),
    (
        "iterator-in-a-dict",
        None,
        (_x(4, 3),),
        {"mask": {"m": iter([1, 2])}},
        TypeError,
        r"`mask\['m'\]` is a list_iterator, a one-shot iterator",
    ),
    (
        "meta-tensor",
        None,
        (torch.zeros(4, 3, device="meta"),),
        {},
        ValueError,
        r"`x` is on meta, but device_ids are \['cpu', 'cpu'\]; inputs must be on the CPU",
    ),
    (
        "meta-tensor-replicated",
        {"mask": None},
        (_x(4, 3),),
        {"mask": torch.zeros(3, device="meta")},
        ValueError,
        r"`mask` is on meta",
    ),
]


@pytest.mark.parametrize(
    "in_dims, args, kwargs, exc, pattern", [r[1:] for r in CALL_ROWS], ids=[r[0] for r in CALL_ROWS]
)
def test_bad_inputs_refused_before_the_module_runs(in_dims, args, kwargs, exc, pattern):
    module = Counting()
    dp = dpfast.DataParallel(module, ["cpu"] * 2, in_dims=in_dims)
    with pytest.raises(exc, match=pattern):
        dp(*args, **kwargs)
    with pytest.raises(exc, match=pattern):
        dp.plan(*args, **kwargs)  # plan() refuses the same inputs the same way
    assert module.calls == 0


def test_the_fix_for_a_one_shot_iterator_works():
    """What the refusal suggests: a list, which every replica gets whole, or a list of per-sample items, split."""
    seen = []

    class Sums(torch.nn.Module):
        def forward(self, x, lengths):
            seen.append(list(lengths))
            return x * sum(seen[-1])

    dp = dpfast.DataParallel(Sums(), ["cpu"] * 2)
    out = dp(torch.ones(4, 1), list(n for n in range(4)))
    assert seen == [[0, 1, 2, 3]] * 2 and out.flatten().tolist() == [6.0] * 4
    seen.clear()
    dpfast.DataParallel(Sums(), ["cpu"] * 2, in_dims={"lengths": "items"})(torch.ones(4, 1), list(range(4)))
    assert seen == [[0, 1], [2, 3]]
    one = dpfast.DataParallel(Sums(), ["cpu"])  # one device: the module is called directly, iterator and all
    assert one(torch.ones(4, 1), (n for n in range(4))).flatten().tolist() == [6.0] * 4


@pytest.mark.cuda
def test_cuda_tensor_in_cpu_rehearsal_is_refused():
    module = Counting()
    with pytest.raises(ValueError, match=r"`x` is on cuda:0, but device_ids are \['cpu', 'cpu'\]"):
        dpfast.DataParallel(module, ["cpu"] * 2)(torch.zeros(4, 3, device="cuda"))
    assert module.calls == 0


def test_out_dims_mismatch_is_refused_at_gather_naming_the_output():
    # outputs exist only after the replicas ran, so out_dims structure is checked then, before anything is gathered
    dp = dpfast.DataParallel(Counting(), ["cpu"] * 2, out_dims=(0, 1))
    with pytest.raises(TypeError, match=r"out_dims for `output` is a tuple of 2 specs, but `output` is a Tensor"):
        dp(_x(4, 3))
    with pytest.raises(ValueError, match=r"output `output` cannot be concatenated along axis 5"):
        dpfast.DataParallel(Counting(), ["cpu"] * 2, out_dims=5)(_x(4, 3))
