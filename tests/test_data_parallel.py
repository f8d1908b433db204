"""dpfast.DataParallel against the plain module: outputs and gradients for every spec form, splits, the seed
models, torch compatibility (state dicts, attributes, single-device and passthrough behaviour), CUDA.

The vehicle is the CPU rehearsal ``device_ids=["cpu"] * n``: n replicas of the same module run concurrently on the
CPU, with the same scatter/gather as on GPUs. Everything is float64 so comparisons are tight.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import namedtuple

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import DT, MLP, Losses, assert_same, check_against_module, fresh_inputs, leaves_of, walk, weighted_loss

Pair = namedtuple("Pair", ["a", "b"])

# ---- modules ---------------------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize("n, chunk_sizes", [(3, None), (4, [1, 2, 2, 2]), (2, [3, 1])])
def test_mean_and_sum_outputs_equal_full_batch(n, chunk_sizes):
    torch.manual_seed(4)
    x, y = torch.randn(7, 4, dtype=DT), torch.randn(7, 2, dtype=DT)
    check_against_module(Losses, (x, y), n=n, chunk_sizes=chunk_sizes, out_dims=("mean", "sum", 0))


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


def test_module_must_live_on_device_ids_zero():
    module = nn.Linear(2, 2, device="meta")
    with pytest.raises(
        RuntimeError,
        match=r"module must have its parameters and buffers on device cpu "
        r"\(device_ids\[0\]\) but found one of them on device: meta",
    ):
        dpfast.DataParallel(module, ["cpu"] * 2)(torch.zeros(3, 2))


# ---- torch compatibility ---------------------------------------------------------------------------------------------


def test_cpu_with_an_index_is_the_cpu():
    """'cpu:0' and torch.device('cpu', 0) name the CPU; CPU tensors report device('cpu'), so comparing against
    'cpu:0' refused every module (and suggested module.to('cpu:0'), which changes nothing)."""
    module = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    for ids in (["cpu:0", "cpu:0"], ["cpu", "cpu:0"], [torch.device("cpu", 0)] * 3):
        dp = dpfast.DataParallel(module, ids, output_device="cpu:0")
        torch.testing.assert_close(dp(x), module(x))
        assert dp.device_ids == [torch.device("cpu")] * len(ids)
        assert dp.output_device == torch.device("cpu")


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


# ---- CUDA (skipped without a GPU) -----------------------------------------------------------------------------------

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


def _cuda_compare(factory, args, kwargs, device_ids, **dp_kwargs):
    torch.manual_seed(0)
    module = factory().to(DT).cuda(0)
    reference = copy.deepcopy(module)
    a1, k1 = fresh_inputs((tuple(args), kwargs))
    a2, k2 = walk(
        fresh_inputs((tuple(args), kwargs)), lambda t: t.detach().cuda(0).requires_grad_(t.is_floating_point())
    )
    dp = dpfast.DataParallel(module, device_ids, **dp_kwargs)
    out = dp(*a1, **k1)
    ref = reference(*a2, **k2)
    assert all(
        t.device == torch.device("cuda", dp.output_device) for t in leaves_of(out) if isinstance(t, torch.Tensor)
    )
    assert_same(walk(out, lambda t: t.cuda(0)), ref)
    weighted_loss(walk(out, lambda t: t.cuda(0))).backward()
    weighted_loss(ref).backward()
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
