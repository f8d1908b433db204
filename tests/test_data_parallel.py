"""dpfast.DataParallel against the plain module: outputs and gradients, every spec form, splits, errors, execution.

The vehicle is the CPU rehearsal ``device_ids=["cpu"] * n``: n replicas of the same module run concurrently on the
CPU, with the same scatter/gather as on GPUs. Everything is float64 so comparisons are tight.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence, pad_packed_sequence

import dpfast

Pair = namedtuple("Pair", ["a", "b"])
DT = torch.float64

# ---- helpers --------------------------------------------------------------------------------------------------------


def _walk(obj: Any, fn):
    """Map ``fn`` over the tensor/PackedSequence leaves of tuples, lists, dicts, namedtuples and dataclasses."""
    if isinstance(obj, (torch.Tensor, PackedSequence)):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        return type(obj)(*(_walk(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_walk(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: _walk(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return type(obj)(**{f.name: _walk(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)})
    return obj


def _leaves(obj: Any) -> list:
    out: list = []
    _walk(obj, lambda t: out.append(t) or t)
    return out


def _fresh_inputs(obj: Any) -> Any:
    """Independent copies of the inputs; floating tensors become leaves that require grad."""

    def f(t):
        if isinstance(t, PackedSequence):
            return t  # rebuilt by the test from its own leaves
        t = t.detach().clone()
        return t.requires_grad_(True) if t.is_floating_point() else t

    return _walk(obj, f)


def _as_comparable(t):
    return pad_packed_sequence(t)[0] if isinstance(t, PackedSequence) else t


def _loss(out: Any) -> torch.Tensor:
    """A fixed, shape-dependent weighted sum of every floating output, so each element's gradient is distinct."""
    total = torch.zeros((), dtype=DT)
    for t in _leaves(out):
        t = _as_comparable(t)
        if t.is_floating_point() and t.requires_grad:
            w = torch.arange(t.numel(), dtype=t.dtype, device=t.device).reshape(t.shape).sin()
            total = total + (t * w).sum()
    return total


def assert_same(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, (torch.Tensor, PackedSequence)):
        torch.testing.assert_close(_as_comparable(actual), _as_comparable(expected))
        return
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            assert_same(actual[k], expected[k])
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(getattr(actual, f.name), getattr(expected, f.name))
    else:
        assert actual == expected


def check_against_module(factory, args, kwargs=None, n=3, expected=None, **dp_kwargs):
    """Run ``DataParallel(module, ['cpu'] * n, **dp_kwargs)`` and the plain module on copies of the same inputs;
    outputs, parameter gradients and input gradients must match. Returns the DataParallel output."""
    kwargs = kwargs or {}
    torch.manual_seed(0)
    module = factory().to(DT)
    reference = copy.deepcopy(module)
    a1, k1 = _fresh_inputs((tuple(args), kwargs))
    a2, k2 = _fresh_inputs((tuple(args), kwargs))
    out = dpfast.DataParallel(module, ["cpu"] * n, **dp_kwargs)(*a1, **k1)
    ref = (expected or (lambda m, *a, **k: m(*a, **k)))(reference, *a2, **k2)
    assert_same(out, ref)
    if _loss(ref).requires_grad:
        _loss(out).backward()
        _loss(ref).backward()
        for (name, p), (_, q) in zip(module.named_parameters(), reference.named_parameters()):
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
        for x, y in zip(_leaves((a1, k1)), _leaves((a2, k2))):
            if isinstance(x, torch.Tensor) and x.requires_grad and y.grad is not None:
                torch.testing.assert_close(x.grad, y.grad)
    return out


# ---- modules ---------------------------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, f=4):
        super().__init__()
        self.l1 = nn.Linear(f, 6)
        self.l2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class Multi(nn.Module):
    """x: (B, T, 4), h: (L, B, 3) (batch on axis 1, like an RNN state), mask: (T, T) with no batch axis."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x, h, mask=None, *, scale=1.0):
        y = self.lin(x)
        if mask is not None:
            y = mask @ y
        y = y * scale + h.sum(0)[:, None, :]
        return y, h * self.w


B, T, L = 7, 5, 2


def multi_inputs(batch=B):
    torch.manual_seed(1)
    return torch.randn(batch, T, 4, dtype=DT), torch.randn(L, batch, 3, dtype=DT), torch.randn(T, T, dtype=DT)


# ---- every spec form --------------------------------------------------------------------------------------------


def _spec_cases():
    x, h, mask = multi_inputs()
    return {
        "dict-positional": (dict(in_dims={"h": 1, "mask": None}, out_dims=(0, 1)), (x, h, mask), {}),
        "dict-keyword": (
            dict(in_dims={"h": 1, "mask": None}, out_dims=(0, 1)),
            (x,),
            {"h": h, "mask": mask, "scale": 2.0},
        ),
        "dict-mixed": (dict(in_dims={"mask": None, "h": 1}, out_dims=[0, 1]), (x, h), {"mask": mask}),
        "sequence": (dict(in_dims=[0, 1, None], out_dims=(0, 1)), (x, h, mask), {}),
        "sequence-short": (dict(in_dims=(0, 1), out_dims=(0, 1)), (x, h), {"mask": None}),
        "negative": (dict(in_dims={"x": -3, "h": -2, "mask": None}, out_dims=(-3, -2)), (x, h, mask), {}),
        "dim-default-for-unnamed": (dict(dim=0, in_dims={"h": 1}, out_dims=(0, 1)), (x, h), {}),
    }


@pytest.mark.parametrize("case", list(_spec_cases()))
@pytest.mark.parametrize("n", [2, 3, 5])
def test_spec_forms(case, n):
    dp_kwargs, args, kwargs = _spec_cases()[case]
    check_against_module(Multi, args, kwargs, n=n, **dp_kwargs)


@pytest.mark.parametrize("n", [2, 4])
def test_default_dim_zero(n):
    check_against_module(MLP, (torch.randn(9, 4, dtype=DT),), n=n)


@pytest.mark.parametrize("how", ["dim", "in_dims"])
def test_batch_on_axis_one_for_everything(how):
    dp_kwargs = dict(dim=1) if how == "dim" else dict(in_dims=1, out_dims=1)
    check_against_module(MLP, (torch.randn(5, 9, 4, dtype=DT),), n=4, **dp_kwargs)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch, pair):
        feats = batch["feats"]
        y = self.lin(batch["ids"] + feats[0] + feats[1].t())
        z = pair.a @ pair.b
        return {"y": y, "yt": y.t(), "pair": Pair(a=z, b=self.lin.weight.sum()), "tag": batch["tag"]}, [y.sum(1)]


def test_nested_structures_in_and_out():
    torch.manual_seed(2)
    batch = {
        "ids": torch.randn(7, 4, dtype=DT),
        "feats": [torch.randn(7, 4, dtype=DT), torch.randn(4, 7, dtype=DT)],
        "tag": "train",
    }
    pair = Pair(a=torch.randn(7, 4, dtype=DT), b=torch.randn(4, 4, dtype=DT))
    out = check_against_module(
        Nested,
        (batch, pair),
        n=3,
        in_dims={"batch": {"feats": (0, 1)}, "pair": Pair(0, None)},
        out_dims=({"y": 0, "yt": 1, "pair": Pair(0, None), "tag": None}, 0),
    )
    assert isinstance(out[0]["pair"], Pair) and isinstance(out[1], list)


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor
    tag: str = "t"


@dataclasses.dataclass
class Out:
    y: torch.Tensor
    tag: str


class DC(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, b: Batch) -> Out:
        return Out(y=self.lin(b.x) @ b.mask, tag=b.tag)


def test_dataclasses_in_and_out():
    torch.manual_seed(3)
    b = Batch(torch.randn(6, 3, dtype=DT), torch.randn(3, 3, dtype=DT), "hello")
    check_against_module(DC, (b,), n=4, in_dims={"b": {"mask": None}}, out_dims={"tag": None})


# ---- splits ---------------------------------------------------------------------------------------------------------


class Recorder(nn.Module):
    """MLP that records the batch each replica sees (list.append is thread-safe)."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return self.mlp(x)


@pytest.mark.parametrize(
    "n, batch, chunk_sizes, expected",
    [
        (2, 7, None, [4, 3]),
        (3, 7, None, [3, 2, 2]),
        (4, 9, None, [3, 2, 2, 2]),
        (5, 13, None, [3, 3, 3, 2, 2]),
        (4, 7, [1, 2, 2, 2], [1, 2, 2, 2]),
        (3, 10, [1, 0, 3], [3, 7]),  # weight 0 skips device 1
        (5, 2, None, [1, 1]),  # B < n: fewer replicas
        (3, 1, None, [1]),
        (4, 0, None, [0]),  # B == 0: one call on device_ids[0]
    ],
)
def test_splits(n, batch, chunk_sizes, expected):
    holder = {}

    def factory():
        holder["m"] = Recorder()
        return holder["m"]

    check_against_module(factory, (torch.randn(batch, 4, dtype=DT),), n=n, chunk_sizes=chunk_sizes)
    assert sorted(holder["m"].seen) == sorted(expected)


class Losses(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, y):
        pred = self.lin(x)
        return F.mse_loss(pred, y), ((pred - y) ** 2).sum(), pred


@pytest.mark.parametrize("n, chunk_sizes", [(3, None), (4, [1, 2, 2, 2]), (2, [3, 1])])
def test_mean_and_sum_outputs_equal_full_batch(n, chunk_sizes):
    torch.manual_seed(4)
    x, y = torch.randn(7, 4, dtype=DT), torch.randn(7, 2, dtype=DT)
    check_against_module(Losses, (x, y), n=n, chunk_sizes=chunk_sizes, out_dims=("mean", "sum", 0))


def test_scalar_outputs_stack_like_torch():
    torch.manual_seed(5)
    module = Losses().to(DT)
    x, y = torch.randn(7, 4, dtype=DT), torch.randn(7, 2, dtype=DT)
    mse, sse, _ = dpfast.DataParallel(module, ["cpu"] * 3)(x, y)
    assert mse.shape == (3,) and sse.shape == (3,)
    expected = torch.stack([module(x[a:b], y[a:b])[1] for a, b in [(0, 3), (3, 5), (5, 7)]])
    torch.testing.assert_close(sse, expected)


def test_none_output_is_replica_zero_value_and_numbers_reduce():
    class M(nn.Module):
        def forward(self, x):
            return {"n": x.shape[0], "first": x[0], "mean_n": float(x.shape[0])}

    out = dpfast.DataParallel(M(), ["cpu"] * 3, out_dims={"n": "sum", "first": None, "mean_n": "mean"})(
        torch.arange(7.0)[:, None]
    )
    assert out["n"] == 7 and out["first"].item() == 0.0
    assert out["mean_n"] == pytest.approx((3 * 3 + 2 * 2 + 2 * 2) / 7)


# ---- the two seed models ---------------------------------------------------------------------------------------------


class Seq(nn.Module):
    """Seed 000: LSTM(batch_first=True) whose state is (num_layers, B, H) — batch on axis 1."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 5, num_layers=L, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x, h):
        out, (hn, cn) = self.lstm(x, h)
        return self.head(out), (hn, cn)


def _seq_inputs(batch=7):
    torch.manual_seed(6)
    x = torch.randn(batch, T, 3, dtype=DT)
    return x, (torch.randn(L, batch, 5, dtype=DT), torch.randn(L, batch, 5, dtype=DT))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_lstm_state_batch_on_axis_one(n):
    check_against_module(Seq, _seq_inputs(), n=n, in_dims={"h": 1}, out_dims=(0, 1))


def test_lstm_state_default_dim_explains_the_fix():
    dp = dpfast.DataParallel(Seq().to(DT), ["cpu"] * 4)
    with pytest.raises(dpfast.ScatterError) as info:
        dp(*_seq_inputs())
    msg = str(info.value)
    assert "h[0]  (2, 7, 5)  0     0     2     <- expected 7; axis 1 has size 7" in msg
    assert msg.endswith("suggested fix: DataParallel(..., in_dims={'h': 1})")


class Attn(nn.Module):
    """Seed 004: a (T, T) attention mask has no batch axis; the padding mask (B, T) does."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, src, tgt_mask=None, pad_mask=None):
        return self.mha(src, src, src, attn_mask=tgt_mask, key_padding_mask=pad_mask, need_weights=False)[0]


def _attn_inputs(batch=6, t=5):
    torch.manual_seed(7)
    src = torch.randn(batch, t, 8, dtype=DT)
    tgt_mask = torch.triu(torch.full((t, t), float("-inf"), dtype=DT), diagonal=1)
    pad = torch.zeros(batch, t, dtype=torch.bool)
    pad[0, -1] = pad[3, -2:] = True
    return src, tgt_mask, pad


def test_attention_mask_replicated():
    src, tgt_mask, pad = _attn_inputs()
    check_against_module(Attn, (src,), dict(tgt_mask=tgt_mask, pad_mask=pad), n=4, in_dims={"tgt_mask": None})


def test_attention_mask_default_dim_explains_the_fix():
    src, tgt_mask, pad = _attn_inputs()
    dp = dpfast.DataParallel(Attn().to(DT), ["cpu"] * 4)
    with pytest.raises(dpfast.ScatterError, match=r"in_dims=\{'tgt_mask': None\}") as info:
        dp(src, tgt_mask=tgt_mask, pad_mask=pad)
    assert "tgt_mask  (5, 5)     0     0     5     <- expected 6; no axis has size 6" in str(info.value)


# ---- PackedSequence -------------------------------------------------------------------------------------------------


class PackedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4)

    def forward(self, ps):
        out, (h, c) = self.lstm(ps)
        return out, h


@pytest.mark.parametrize("n", [2, 3])
def test_packed_sequence_split_by_sequence(n):
    torch.manual_seed(8)
    lengths = [3, 5, 1, 4, 4, 2, 5]
    seqs1 = [torch.randn(k, 3, dtype=DT, requires_grad=True) for k in lengths]
    seqs2 = [s.detach().clone().requires_grad_(True) for s in seqs1]
    module = PackedLSTM().to(DT)
    reference = copy.deepcopy(module)
    dp = dpfast.DataParallel(module, ["cpu"] * n, out_dims=(0, 1))
    out, h = dp(pack_sequence(seqs1, enforce_sorted=False))
    ref_out, ref_h = reference(pack_sequence(seqs2, enforce_sorted=False))
    assert isinstance(out, PackedSequence)
    padded, lens = pad_packed_sequence(out)
    ref_padded, ref_lens = pad_packed_sequence(ref_out)
    torch.testing.assert_close(lens, ref_lens)
    torch.testing.assert_close(padded, ref_padded)
    torch.testing.assert_close(h, ref_h)
    _loss((padded, h)).backward()
    _loss((ref_padded, ref_h)).backward()
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


# ---- output errors ---------------------------------------------------------------------------------------------------


def test_output_errors():
    class Ragged(nn.Module):
        def forward(self, x):
            return (x,) if x.shape[0] == 2 else [x]

    with pytest.raises(
        ValueError,
        match=r"replicas returned different output structures: replica 0 returned a "
        r"tuple of length 1, replica 1 returned a list of length 1",
    ):
        dpfast.DataParallel(Ragged(), ["cpu"] * 2)(torch.zeros(3))

    class Label(nn.Module):
        def forward(self, x):
            return x, "label"

    # non-tensor outputs equal across replicas come back once (tests/test_structured.py has the list case)
    assert dpfast.DataParallel(Label(), ["cpu"] * 2)(torch.zeros(3))[1] == "label"

    class Mixed(nn.Module):
        def forward(self, x):
            return x, (x if x.shape[0] == 2 else "label")

    with pytest.raises(
        TypeError,
        match=r"output `output\[1\]` is Tensor/str, which cannot be concatenated along "
        r"axis 0; give it out_dims None",
    ):
        dpfast.DataParallel(Mixed(), ["cpu"] * 2)(torch.zeros(3))
    out = dpfast.DataParallel(Label(), ["cpu"] * 2, out_dims=(0, None))(torch.zeros(3))
    assert out[1] == "label"

    with pytest.raises(
        ValueError,
        match=r"output `output` cannot be concatenated along axis 2: replica 0 returned "
        r"shape \(2, 1\)",
    ):
        dpfast.DataParallel(nn.Identity(), ["cpu"] * 2, out_dims=2)(torch.zeros(3, 1))

    class Varying(nn.Module):
        def forward(self, x):
            return torch.zeros(x.shape[0], x.shape[0])

    with pytest.raises(
        ValueError,
        match=r"output `output` cannot be concatenated along axis 0: replica 1 returned "
        r"\(1, 1\) torch.float32, replica 0 \(2, 2\)",
    ):
        dpfast.DataParallel(Varying(), ["cpu"] * 2)(torch.zeros(3))
    with pytest.raises(ValueError, match=r"output `output` cannot be averaged across replicas"):
        dpfast.DataParallel(Varying(), ["cpu"] * 2, out_dims="mean")(torch.zeros(3))
    with pytest.raises(TypeError, match=r"output `output\[1\]` is str; out_dims 'sum' needs tensors or numbers"):
        dpfast.DataParallel(Label(), ["cpu"] * 2, out_dims=(0, "sum"))(torch.zeros(3))


def test_out_dims_structure_errors():
    dp = dpfast.DataParallel(Losses(), ["cpu"] * 2, out_dims=("mean", "sum"))
    with pytest.raises(ValueError, match=r"out_dims for `output` has 2 specs but `output` is a tuple of length 3"):
        dp(torch.randn(4, 4), torch.randn(4, 2))
    dp = dpfast.DataParallel(Losses(), ["cpu"] * 2, out_dims={"loss": "mean"})
    with pytest.raises(
        TypeError,
        match=r"out_dims for `output` is a dict with keys \['loss'\], but `output` is a "
        r"tuple of length 3",
    ):
        dp(torch.randn(4, 4), torch.randn(4, 2))


def test_module_must_live_on_device_ids_zero():
    module = nn.Linear(2, 2, device="meta")
    with pytest.raises(
        RuntimeError,
        match=r"module must have its parameters and buffers on device cpu "
        r"\(device_ids\[0\]\) but found one of them on device: meta",
    ):
        dpfast.DataParallel(module, ["cpu"] * 2)(torch.zeros(3, 2))


# ---- execution -------------------------------------------------------------------------------------------------------


class Fails(nn.Module):
    def forward(self, x):
        if (x < 0).any():
            raise ValueError(f"negative input in a chunk of {x.shape[0]}")
        return x


def test_replica_exception_names_replica_and_device():
    x = torch.tensor([1.0, 2, 3, 4, 5, -6, 7])  # chunks [2, 2, 2, 1] on 4 replicas: -6 lands in replica 2
    with pytest.raises(ValueError, match=r"^replica 2 on cpu raised ValueError: negative input in a chunk of 2$") as e:
        dpfast.DataParallel(Fails(), ["cpu"] * 4)(x)
    cause = e.value.__cause__
    assert type(cause) is ValueError and str(cause) == "negative input in a chunk of 2"
    assert cause.__traceback__ is not None


def test_no_work_left_behind_and_no_thread_growth():
    finished = []

    class SlowAndFailing(nn.Module):
        def forward(self, x):
            if x.shape[0] == 1:
                raise ValueError("fast failure")
            time.sleep(0.2)
            finished.append(x.shape[0])
            return x

    dp = dpfast.DataParallel(SlowAndFailing(), ["cpu"] * 3)
    with pytest.raises(ValueError, match="replica 2 on cpu raised ValueError: fast failure"):
        dp(torch.zeros(5))  # chunks [2, 2, 1]
    assert sorted(finished) == [2, 2]  # the call raised only after the slow replicas had finished
    before = threading.active_count()
    for _ in range(5):
        with pytest.raises(ValueError):
            dp(torch.zeros(5))
        dpfast.DataParallel(Fails(), ["cpu"] * 3)(torch.ones(6))
    # idle workers are reused, not piled up; the pools of the discarded instances stop their workers as they are
    # collected, which happens on other threads' time: wait for that rather than race it
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= before


def test_replica_exception_several_and_unbuildable_types():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    class M(nn.Module):
        def forward(self, x):
            raise Odd(x.shape[0], "x")

    with pytest.raises(RuntimeError, match=r"^replica 0 on cpu raised Odd: 2/x \(2 other replicas failed too\)$") as e:
        dpfast.DataParallel(M(), ["cpu"] * 3)(torch.zeros(6))
    assert isinstance(e.value.__cause__, Odd)


def test_single_replica_runs_inline_and_raises_unchanged():
    threads = []

    class M(nn.Module):
        def forward(self, x):
            threads.append(threading.current_thread())
            if x.shape[0] == 0:
                raise KeyError("empty")
            return x

    dp = dpfast.DataParallel(M(), ["cpu"] * 4)
    dp(torch.zeros(1, 2))
    assert threads == [threading.current_thread()]
    with pytest.raises(KeyError, match="empty"):
        dp(torch.zeros(0, 2))


def test_replicas_run_in_threads_with_grad_inference_and_autocast_state():
    seen = []

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            seen.append(
                (threading.current_thread().name, torch.is_grad_enabled(), torch.is_inference_mode_enabled(), y.dtype)
            )
            return y

    dp = dpfast.DataParallel(M(), ["cpu"] * 3)
    x = torch.randn(6, 4)
    assert dp(x).requires_grad
    assert (
        len({s[0] for s in seen}) == 3
        and all(  # one thread per replica (names: idents get reused)
            s[1:] == (True, False, torch.float32) for s in seen
        )
    )
    seen.clear()
    with torch.no_grad():
        assert not dp(x).requires_grad
    assert all(s[1:] == (False, False, torch.float32) for s in seen)
    seen.clear()
    with torch.inference_mode():
        dp(x)
    assert all(s[1:] == (False, True, torch.float32) for s in seen)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dp(x).dtype == torch.bfloat16
    assert all(s[1:] == (True, False, torch.bfloat16) for s in seen)
    seen.clear()
    dp(x)
    assert all(s[3] == torch.float32 for s in seen)  # the autocast state did not leak into the workers


@pytest.mark.skipif(
    not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"),
    reason="passing saved-tensor hooks to the replicas needs torch >= 2.8 (older torch: a warning, "
    "tests/test_torch_compat.py)",
)
def test_saved_tensor_hooks_reach_every_replica():
    """save_on_cpu-style hooks set around the call apply in the worker threads too, and only during the call."""
    packed = []

    def pack(t):
        packed.append(threading.current_thread().name)
        return t.clone()  # a copy, as an offloading hook would make

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    dp = dpfast.DataParallel(module, ["cpu"] * 3)
    x = torch.randn(9, 4)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = dp(x)
    assert len(set(packed)) == 3  # the caller and both workers packed their replicas' saved tensors
    out.square().sum().backward()
    got = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    module(x).square().sum().backward()
    for g, p in zip(got, module.parameters()):
        torch.testing.assert_close(g, p.grad)
    packed.clear()
    dp(x)
    assert packed == []  # the hooks did not stay behind in the workers


# ---- torch compatibility ---------------------------------------------------------------------------------------------


def test_state_dict_keys_and_attributes_match_torch():
    module = Seq()
    ours = dpfast.DataParallel(module, ["cpu"] * 2, in_dims={"h": 1})
    theirs = nn.DataParallel(copy.deepcopy(module))  # (torch may move its module to a GPU)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(k.startswith("module.") for k in ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert ours.module is module and ours.dim == 0
    assert ours.device_ids == [torch.device("cpu")] * 2 and ours.output_device == torch.device("cpu")
    assert "in_dims={'h': 1}" in repr(ours)


@pytest.mark.skipif(torch.cuda.is_available(), reason="passthrough only without CUDA")
def test_passthrough_without_cuda_and_device_ids():
    module = Losses()
    dp = dpfast.DataParallel(module)
    assert dp.device_ids == [] and dp.output_device is None
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    out = dp(x, y)
    assert out[0].dim() == 0  # the module's own output, not stacked
    torch.testing.assert_close(out[2], module(x, y)[2])
    assert "called directly" in str(dp.plan(x, y))


def test_single_device_behaves_like_torch():
    module = Losses()
    dp = dpfast.DataParallel(module, ["cpu"])
    loss = dp(torch.randn(5, 4), torch.randn(5, 2))[0]
    assert loss.dim() == 0  # not stacked: one device calls the module directly, as torch does
    # nothing is split on one device, so a (T, T) mask needs no spec
    attn = Attn()
    src, tgt_mask, pad = _attn_inputs()
    dpfast.DataParallel(attn.to(DT), ["cpu"])(src, tgt_mask, pad)


def test_nothing_to_split_runs_once():
    calls = []

    class M(nn.Module):
        def forward(self, n, table):
            calls.append(n)
            return table * n

    out = dpfast.DataParallel(M(), ["cpu"] * 3, in_dims={"table": None})(3, torch.ones(2))
    assert calls == [3] and out.tolist() == [3.0, 3.0]


# ---- properties ---------------------------------------------------------------------------------------------------


class Echo(nn.Module):
    def forward(self, a, b):
        return a, b


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_scatter_gather_identity(data):
    n = data.draw(st.integers(1, 5), label="n")
    batch = data.draw(st.integers(0, 12), label="B")
    ndim_a = data.draw(st.integers(1, 3), label="ndim a")
    ndim_b = data.draw(st.integers(1, 3), label="ndim b")
    da = data.draw(st.integers(-ndim_a, ndim_a - 1), label="dim a")
    db = data.draw(st.integers(-ndim_b, ndim_b - 1), label="dim b")
    weights = data.draw(st.none() | st.lists(st.integers(0, 4), min_size=n, max_size=n).filter(any), label="w")

    def shape(ndim, d):
        s = [data.draw(st.integers(1, 3)) for _ in range(ndim)]
        s[d] = batch
        return s

    a = torch.randn(shape(ndim_a, da), dtype=DT, requires_grad=True)
    b = torch.randint(0, 100, shape(ndim_b, db))
    dp = dpfast.DataParallel(Echo(), ["cpu"] * n, in_dims=[da, db], out_dims=(da, db), chunk_sizes=weights)
    plan = dp.plan(a, b)
    assert sum(s for _, _, s in plan.replicas) == batch
    out_a, out_b = dp(a, b)
    assert torch.equal(out_a, a) and torch.equal(out_b, b)
    if n > 1:
        assert out_a is not a  # moved through the ops, not aliased (one device calls the module directly)
    if batch:
        out_a.sum().backward()
        assert torch.equal(a.grad, torch.ones_like(a))


# ---- CUDA (skipped without a GPU) -----------------------------------------------------------------------------------

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _cuda_compare(factory, args, kwargs, device_ids, **dp_kwargs):
    torch.manual_seed(0)
    module = factory().to(DT).cuda(0)
    reference = copy.deepcopy(module)
    a1, k1 = _fresh_inputs((tuple(args), kwargs))
    a2, k2 = _walk(
        _fresh_inputs((tuple(args), kwargs)), lambda t: t.detach().cuda(0).requires_grad_(t.is_floating_point())
    )
    dp = dpfast.DataParallel(module, device_ids, **dp_kwargs)
    out = dp(*a1, **k1)
    ref = reference(*a2, **k2)
    assert all(t.device == torch.device("cuda", dp.output_device) for t in _leaves(out) if isinstance(t, torch.Tensor))
    assert_same(_walk(out, lambda t: t.cuda(0)), ref)
    _loss(_walk(out, lambda t: t.cuda(0))).backward()
    _loss(ref).backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.cuda
def test_cuda_rehearsal_on_one_gpu():
    _cuda_compare(Seq, _seq_inputs(), {}, [0, 0, 0], in_dims={"h": 1}, out_dims=(0, 1))


@pytest.mark.cuda
@needs_two_gpus
@pytest.mark.parametrize("output_device", [None, 1])
def test_cuda_two_gpus_lstm_state(output_device):
    _cuda_compare(Seq, _seq_inputs(), {}, [0, 1], in_dims={"h": 1}, out_dims=(0, 1), output_device=output_device)


@pytest.mark.cuda
@needs_two_gpus
def test_cuda_two_gpus_mask_and_mean():
    src, tgt_mask, pad = _attn_inputs()
    _cuda_compare(
        Attn, (src,), dict(tgt_mask=tgt_mask, pad_mask=pad), ["cuda:0", "cuda:1", "cuda:1"], in_dims={"tgt_mask": None}
    )
    torch.manual_seed(4)
    _cuda_compare(
        Losses,
        (torch.randn(7, 4, dtype=DT), torch.randn(7, 2, dtype=DT)),
        {},
        [0, 1],
        chunk_sizes=[1, 3],
        out_dims=("mean", "sum", 0),
    )


@pytest.mark.cuda
@needs_two_gpus
def test_cuda_module_on_wrong_device():
    with pytest.raises(
        RuntimeError, match=r"on device cuda:0 \(device_ids\[0\]\) but found one of them on device: cpu"
    ):
        dpfast.DataParallel(nn.Linear(2, 2), [0, 1])(torch.zeros(4, 2))


@pytest.mark.cuda
def test_cuda_device_type_mixing_and_streams_and_autocast():
    with pytest.raises(ValueError, match=r"device_ids mix device types"):
        dpfast.DataParallel(nn.Linear(2, 2), [0, "cpu"])
    seen = []

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            seen.append((torch.cuda.current_stream(x.device), y.dtype, x.device))
            return y

    dp = dpfast.DataParallel(M().cuda(0), [0, 0])
    side = torch.cuda.Stream(0)
    with torch.cuda.stream(side), torch.autocast("cuda", dtype=torch.float16):
        out = dp(torch.randn(6, 4, device="cuda:0"))
    side.synchronize()
    assert out.dtype == torch.float16
    assert [s[0] for s in seen] == [side, side] and all(s[1] == torch.float16 for s in seen)
