"""dpfast.nn.LSTM/GRU/RNN against the torch modules with the same weights, in float64.

With ``state_batch_first=True`` the only difference from torch must be the state layout: ``(B, L*D, H)`` instead of
``(L*D, B, H)``. So every comparison feeds torch the layer-first transpose of our state and checks that outputs,
returned states and gradients (input, initial state, parameters) agree.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)  # the extension may not be built: ops fall back, same results
    import dpfast
    import dpfast.nn as dnn

DTYPE = torch.float64
F_IN, HID, PROJ, B, T = 5, 6, 4, 5, 4
CLASSES = {"LSTM": (dnn.LSTM, torch.nn.LSTM), "GRU": (dnn.GRU, torch.nn.GRU), "RNN": (dnn.RNN, torch.nn.RNN)}


pytestmark = pytest.mark.usefixtures("one_thread")


def make_pair(kind: str, device: str, **kwargs: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ours with state_batch_first=True, torch's) sharing weights through the state dict."""
    ours_cls, torch_cls = CLASSES[kind]
    torch.manual_seed(0)
    ref = torch_cls(F_IN, HID, **kwargs).to(device, DTYPE)
    ours = ours_cls(F_IN, HID, state_batch_first=True, **kwargs).to(device, DTYPE)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def state_shapes(mod: torch.nn.Module, batch: int) -> list[tuple[int, ...]]:
    """Layer-first shapes of torch's state: [h] or [h, c]."""
    ld = mod.num_layers * (2 if mod.bidirectional else 1)
    h_out = mod.proj_size if getattr(mod, "proj_size", 0) > 0 else mod.hidden_size
    shapes = [(ld, batch, h_out)]
    if isinstance(mod, torch.nn.LSTM):
        shapes.append((ld, batch, mod.hidden_size))
    return shapes


def as_list(state: Any) -> list[Tensor]:
    return list(state) if isinstance(state, tuple) else [state]


def pack_state(mod: torch.nn.Module, tensors: list[Tensor]) -> Any:
    return tuple(tensors) if isinstance(mod, torch.nn.LSTM) else tensors[0]


def output_tensor(out: Any) -> Tensor:
    return out.data if isinstance(out, PackedSequence) else out


def leaf(x: Tensor) -> Tensor:
    return x.detach().clone().requires_grad_(True)


def run_and_compare(
    ours: torch.nn.Module,
    ref: torch.nn.Module,
    make_input: Any,
    layer_first_state: list[Tensor] | None,
    to_ours: Any,
) -> None:
    """Run both modules on the same data; ``to_ours`` maps a layer-first state tensor to our layout.

    ``make_input(x_leaf)`` builds the module input (a tensor or a PackedSequence) from a leaf tensor, so that the
    input gradient can be compared too.
    """
    x0 = make_input.base
    x_ref, x_ours = leaf(x0), leaf(x0)
    s_ref = s_ours = None
    if layer_first_state is not None:
        s_ref = [leaf(s) for s in layer_first_state]
        s_ours = [leaf(to_ours(s)) for s in layer_first_state]
    out_ref, st_ref = ref(make_input(x_ref), None if s_ref is None else pack_state(ref, s_ref))
    out_ours, st_ours = ours(make_input(x_ours), None if s_ours is None else pack_state(ours, s_ours))

    assert type(out_ours) is type(out_ref)
    assert type(st_ours) is type(st_ref)
    if isinstance(out_ref, PackedSequence):
        for a, b in zip(out_ours[1:], out_ref[1:]):
            assert (a is None and b is None) or torch.equal(a, b)
    torch.testing.assert_close(output_tensor(out_ours), output_tensor(out_ref), rtol=0, atol=1e-12)
    st_ours_l, st_ref_l = as_list(st_ours), as_list(st_ref)
    assert len(st_ours_l) == len(st_ref_l)
    for a, b in zip(st_ours_l, st_ref_l):
        assert a.is_contiguous()
        torch.testing.assert_close(a, to_ours(b), rtol=0, atol=1e-12)

    # One backward through every returned tensor, with random weights so that a wrong permutation shows up.
    g = torch.Generator(device="cpu").manual_seed(1)

    def weights(t: Tensor) -> Tensor:
        return torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device)

    w_out = weights(output_tensor(out_ref))
    w_st = [weights(s) for s in st_ref_l]
    loss_ref = (output_tensor(out_ref) * w_out).sum() + sum((s * w).sum() for s, w in zip(st_ref_l, w_st))
    loss_ours = (output_tensor(out_ours) * w_out).sum() + sum((s * to_ours(w)).sum() for s, w in zip(st_ours_l, w_st))
    loss_ref.backward()
    loss_ours.backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=1e-11)
    if s_ref is not None:
        for a, b in zip(s_ours, s_ref):
            torch.testing.assert_close(a.grad, to_ours(b.grad), rtol=0, atol=1e-11)
    for (name, p), (name_r, p_r) in zip(ours.named_parameters(), ref.named_parameters()):
        assert name == name_r
        torch.testing.assert_close(
            p.grad, p_r.grad, rtol=0, atol=1e-11, msg=lambda m, name=name: f"grad of {name}: {m}"
        )


def batch_first_of(s: Tensor) -> Tensor:
    return s.transpose(0, 1)


def identity(s: Tensor) -> Tensor:
    return s


class Input:
    """A callable building the module input from a leaf tensor; ``base`` is the data."""

    def __init__(self, base: Tensor, build: Any = None) -> None:
        self.base = base
        self.build = build

    def __call__(self, x: Tensor) -> Any:
        return x if self.build is None else self.build(x)


# ---------------------------------------------------------------------------------------------------------------
# Equivalence with torch
# ---------------------------------------------------------------------------------------------------------------

CONFIGS = [
    pytest.param(kind, layers, bidir, proj, id=f"{kind}-L{layers}-{'bi' if bidir else 'uni'}{'-proj' if proj else ''}")
    for kind in ("LSTM", "GRU", "RNN")
    for layers in (1, 2, 3)
    for bidir in (False, True)
    for proj in ((False, True) if kind == "LSTM" else (False,))
]


@pytest.mark.parametrize("with_state", [True, False], ids=["hx", "no_hx"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("kind,layers,bidir,proj", CONFIGS)
def test_matches_torch(device, kind, layers, bidir, proj, batch_first, with_state):
    kwargs: dict = dict(num_layers=layers, bidirectional=bidir, batch_first=batch_first)
    if proj:
        kwargs["proj_size"] = PROJ
    if kind == "RNN" and layers == 2:
        kwargs["nonlinearity"] = "relu"  # cover both RNN flavours
    ours, ref = make_pair(kind, device, **kwargs)
    torch.manual_seed(2)
    shape = (B, T, F_IN) if batch_first else (T, B, F_IN)
    x = torch.randn(shape, dtype=DTYPE, device=device)
    state = [torch.randn(s, dtype=DTYPE, device=device) for s in state_shapes(ref, B)] if with_state else None
    run_and_compare(ours, ref, Input(x), state, batch_first_of)


@pytest.mark.parametrize("with_state", [True, False], ids=["hx", "no_hx"])
@pytest.mark.parametrize("bidir", [False, True], ids=["uni", "bi"])
@pytest.mark.parametrize("kind", ["LSTM", "LSTM-proj", "GRU", "RNN"])
def test_packed_sequence_unsorted(device, kind, bidir, with_state):
    """Unsorted lengths: the state's batch axis is in the caller's order, as in torch (which permutes it)."""
    kwargs: dict = dict(num_layers=2, bidirectional=bidir, batch_first=True)
    if kind == "LSTM-proj":
        kind, kwargs["proj_size"] = "LSTM", PROJ
    ours, ref = make_pair(kind, device, **kwargs)
    torch.manual_seed(3)
    lengths = torch.tensor([2, 4, 1, 3, 4])  # unsorted, with a tie
    x = torch.randn(B, T, F_IN, dtype=DTYPE, device=device)
    build = lambda t: pack_padded_sequence(t, lengths, batch_first=True, enforce_sorted=False)  # noqa: E731
    assert build(x).unsorted_indices is not None and not torch.equal(
        build(x).sorted_indices, torch.arange(B, device=build(x).sorted_indices.device)
    )
    state = [torch.randn(s, dtype=DTYPE, device=device) for s in state_shapes(ref, B)] if with_state else None
    run_and_compare(ours, ref, Input(x, build), state, batch_first_of)


def test_packed_state_is_in_caller_order(device):
    """Row i of the returned batch-first state belongs to sequence i: it equals running sequence i alone."""
    ours, _ = make_pair("GRU", device, num_layers=2, batch_first=True)
    torch.manual_seed(4)
    lengths = [2, 4, 1]
    x = torch.randn(3, 4, F_IN, dtype=DTYPE, device=device)
    h0 = torch.randn(3, 2, HID, dtype=DTYPE, device=device)
    packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    out, h = ours(packed, h0)
    padded, _ = pad_packed_sequence(out, batch_first=True)
    for i, n in enumerate(lengths):
        out_i, h_i = ours(x[i : i + 1, :n], h0[i : i + 1])
        torch.testing.assert_close(h[i : i + 1], h_i, rtol=0, atol=1e-12)
        torch.testing.assert_close(padded[i : i + 1, :n], out_i, rtol=0, atol=1e-12)


@pytest.mark.parametrize("with_state", [True, False], ids=["hx", "no_hx"])
@pytest.mark.parametrize("kind", ["LSTM", "LSTM-proj", "GRU", "RNN"])
def test_unbatched_input_keeps_torch_state(device, kind, with_state):
    """2-D input: torch's state is (L*D, H) with no batch axis, so it is passed and returned unchanged."""
    kwargs: dict = dict(num_layers=2, bidirectional=True)
    if kind == "LSTM-proj":
        kind, kwargs["proj_size"] = "LSTM", PROJ
    ours, ref = make_pair(kind, device, **kwargs)
    torch.manual_seed(5)
    x = torch.randn(T, F_IN, dtype=DTYPE, device=device)
    state = [torch.randn(s[0], s[2], dtype=DTYPE, device=device) for s in state_shapes(ref, 1)] if with_state else None
    run_and_compare(ours, ref, Input(x), state, identity)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_default_is_torch(device, kind):
    """state_batch_first=False (the default): torch's layer-first state, torch's results."""
    ours_cls, torch_cls = CLASSES[kind]
    torch.manual_seed(0)
    ref = torch_cls(F_IN, HID, num_layers=2, batch_first=True).to(device, DTYPE)
    ours = ours_cls(F_IN, HID, num_layers=2, batch_first=True).to(device, DTYPE)
    assert ours.state_batch_first is False
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(B, T, F_IN, dtype=DTYPE, device=device)
    state = [torch.randn(s, dtype=DTYPE, device=device) for s in state_shapes(ref, B)]
    run_and_compare(ours, ref, Input(x), state, identity)


# ---------------------------------------------------------------------------------------------------------------
# Module surface: repr, state dict, pickling, errors
# ---------------------------------------------------------------------------------------------------------------


def test_repr():
    assert repr(dnn.LSTM(3, 4, batch_first=True, state_batch_first=True)) == (
        "LSTM(3, 4, batch_first=True, state_batch_first=True)"
    )
    gru = dnn.GRU(3, 4, num_layers=2, state_batch_first=True)
    assert repr(gru) == "GRU(3, 4, num_layers=2, state_batch_first=True)"
    assert repr(dnn.RNN(3, 4)) == repr(torch.nn.RNN(3, 4)) == "RNN(3, 4)"


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_state_dict_round_trip(kind):
    ours_cls, torch_cls = CLASSES[kind]
    kwargs: dict = dict(num_layers=2, bidirectional=True)
    if kind == "LSTM":
        kwargs["proj_size"] = 3
    ref, ours = torch_cls(F_IN, HID, **kwargs), ours_cls(F_IN, HID, state_batch_first=True, **kwargs)
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert list(ours.buffers()) == []
    ours.load_state_dict(ref.state_dict())  # strict: same keys, same shapes
    for (k, a), (_, b) in zip(ours.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k
    ours2 = ours_cls(F_IN, HID, state_batch_first=True, **kwargs)
    ref.load_state_dict(ours2.state_dict())
    for (k, a), (_, b) in zip(ours2.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k


def test_deepcopy_and_pickle_keep_option():
    import copy
    import io

    m = dnn.LSTM(3, 4, state_batch_first=True)
    assert copy.deepcopy(m).state_batch_first is True
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).state_batch_first is True


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_bad_state_shapes_name_the_expected_layout():
    gru = dnn.GRU(F_IN, 8, state_batch_first=True)
    x = torch.randn(T, 3, F_IN)  # seq-first, B = 3
    with pytest.raises(RuntimeError) as e:
        gru(x, torch.zeros(1, 3, 8))  # torch's layer-first layout passed by mistake
    assert str(e.value) == (
        "hx has shape (1, 3, 8) but state_batch_first=True expects (B, num_layers*num_directions, H) = (3, 1, 8)"
    )
    with pytest.raises(RuntimeError, match=r"hx has shape \(1, 4, 8\) .* = \(3, 1, 8\)"):
        gru(x, torch.zeros(1, 4, 8))
    with pytest.raises(RuntimeError, match=r"hx has shape \(3, 8\) .* = \(3, 1, 8\)"):
        gru(x, torch.zeros(3, 8))

    lstm = dnn.LSTM(F_IN, 8, num_layers=2, bidirectional=True, proj_size=2, batch_first=True, state_batch_first=True)
    xb = torch.randn(3, T, F_IN)
    h, c = torch.zeros(3, 4, 2), torch.zeros(3, 4, 8)
    lstm(xb, (h, c))  # the right shapes work
    with pytest.raises(RuntimeError) as e:
        lstm(xb, (torch.zeros(4, 3, 2), c))  # torch's layout passed by mistake
    assert str(e.value) == (
        "hx[0] (h) has shape (4, 3, 2) but state_batch_first=True expects "
        "(B, num_layers*num_directions, proj_size) = (3, 4, 2)"
    )
    expected_c = r"hx\[1\] \(c\) has shape \(3, 4, 2\) .*\(B, num_layers\*num_directions, H\) = \(3, 4, 8\)"
    with pytest.raises(RuntimeError, match=expected_c):
        lstm(xb, (h, torch.zeros(3, 4, 2)))
    with pytest.raises(TypeError, match=r"tuple \(h, c\)"):
        lstm(xb, h)
    with pytest.raises(TypeError, match="must be a Tensor"):
        dnn.RNN(F_IN, 8, state_batch_first=True)(x, [torch.zeros(3, 1, 8)])

    # PackedSequence: B is the number of sequences.
    packed = pack_padded_sequence(xb, torch.tensor([2, 4, 1]), batch_first=True, enforce_sorted=False)
    with pytest.raises(RuntimeError, match=r"= \(3, 4, 2\)"):
        lstm(packed, (torch.zeros(2, 4, 2), c))


# ---------------------------------------------------------------------------------------------------------------
# torch.compile and data parallelism
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(
    torch.__version__ < "2.13",
    reason="torch.compile(fullgraph=True) of recurrent layers needs torch >= 2.13 (before, dynamo gets even plain "
    "torch.nn.LSTM's state shapes wrong)",
)
@pytest.mark.skipif(
    not dpfast.build_info()["extension_loaded"],
    reason="fullgraph tracing goes through the ops' fake kernels, registered with the extension's ops",
)
def test_torch_compile_fullgraph(device):
    """One compiled forward + backward. Dynamo refuses every RNN module (nn.LSTM included) unless
    ``allow_rnn=True``; with it the whole forward, state conversions included, traces as one graph.
    ``aot_eager`` checks dynamo + AOT autograd (fake kernels, autograd of the ops) without inductor's compile time.
    """
    ours, ref = make_pair("LSTM", device, num_layers=2, batch_first=True, proj_size=PROJ)
    torch.manual_seed(6)
    x = torch.randn(B, T, F_IN, dtype=DTYPE, device=device)
    h = torch.randn(B, 2, PROJ, dtype=DTYPE, device=device)
    c = torch.randn(B, 2, HID, dtype=DTYPE, device=device)

    def step(m: torch.nn.Module, x: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, ...]:
        out, (h1, c1) = m(x, (h, c))
        return out, h1, c1

    leaves_e = [leaf(t) for t in (x, h, c)]
    eager = step(ours, *leaves_e)
    sum(t.sum() * (i + 1) for i, t in enumerate(eager)).backward()
    grads_e = [t.grad for t in leaves_e] + [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()

    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        leaves_c = [leaf(t) for t in (x, h, c)]
        got = compiled(ours, *leaves_c)
        sum(t.sum() * (i + 1) for i, t in enumerate(got)).backward()
    torch._dynamo.reset()
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    grads_c = [t.grad for t in leaves_c] + [p.grad for p in ours.parameters()]
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def _dp_case(kind: str, device: str) -> tuple[torch.nn.Module, Tensor, Any]:
    ours_cls, _ = CLASSES[kind]
    torch.manual_seed(7)
    kwargs: dict = dict(num_layers=2, bidirectional=True, batch_first=True, state_batch_first=True)
    if kind == "LSTM":
        kwargs["proj_size"] = PROJ
    m = ours_cls(F_IN, HID, **kwargs).to(device, DTYPE)
    batch = 7  # 3 replicas: an uneven split
    x = torch.randn(batch, T, F_IN, dtype=DTYPE, device=device)
    shapes = [(batch,) + s[:1] + s[2:] for s in state_shapes(m, 1)]
    state = [torch.randn(s, dtype=DTYPE, device=device) for s in shapes]
    return m, x, pack_state(m, state)


def _flat(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    return [t for sub in tree for t in _flat(sub)]


def _compare_parallel(plain: torch.nn.Module, parallel: torch.nn.Module, x: Tensor, state: Any) -> None:
    """``parallel(x, state)`` must equal ``plain(x, state)``: outputs, states and all gradients."""
    results = []
    for call in (plain, parallel):
        plain.zero_grad()
        xl = leaf(x)
        sl = tuple(leaf(s) for s in state) if isinstance(state, tuple) else leaf(state)
        out = call(xl, sl)
        flat = _flat(out)
        sum(t.sum() * (i + 1) for i, t in enumerate(flat)).backward()
        grads = [xl.grad] + [s.grad for s in _flat(sl)] + [p.grad.clone() for p in plain.parameters()]
        results.append(([t.detach() for t in flat], grads))
    (out_p, grads_p), (out_d, grads_d) = results
    assert [t.shape for t in out_d] == [t.shape for t in out_p]
    for a, b in zip(out_d, out_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    for a, b in zip(grads_d, grads_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_dpfast_data_parallel_cpu_rehearsal(kind):
    """Default dim=0 everywhere: the batch-first state splits with the input, and the returned state gathers back."""
    if importlib.util.find_spec("dpfast.data_parallel") is None:
        pytest.skip("dpfast.data_parallel (dpfast.DataParallel) is not in this tree yet")
    m, x, state = _dp_case(kind, "cpu")
    dp = dpfast.DataParallel(m, device_ids=["cpu"] * 3)
    _compare_parallel(m, dp, x, state)
    # It really split: three replicas, B = 7 as 3 + 2 + 2, the state with the input.
    seen: list[tuple[int, int]] = []
    hook = m.register_forward_hook(lambda mod, args, out: seen.append((args[0].shape[0], _flat(args[1])[0].shape[0])))
    try:
        with torch.no_grad():
            dp(x, state)
    finally:
        hook.remove()
    assert sorted(seen) == [(2, 2), (2, 2), (3, 3)]


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_torch_data_parallel_cuda(kind):
    """torch.nn.DataParallel with its default dim=0 on every visible GPU (without CUDA it just calls the module).

    With a single GPU this covers torch's scatter/gather path to one device; with several, a real split.
    """
    m, x, state = _dp_case(kind, "cuda")
    dp = torch.nn.DataParallel(m)
    _compare_parallel(m, dp, x, state)
