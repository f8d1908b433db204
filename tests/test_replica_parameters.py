"""Code that reads a replica's parameters sees them on every replica as on replica 0 (the module itself), or gets
a clear error: a dtype or device probe, ``torch.func.functional_call``, diffusers' models; opacus' per-sample
gradients, which replicas cannot fill in together, are refused before anything runs."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import dpfast

from dp_testing import DT

pytestmark = pytest.mark.usefixtures("one_thread")


class Probing(nn.Module):
    """Reads its own parameters in forward, as many models do (a dtype probe, functional_call)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 2)

    def forward(self, x):
        dtype = next(self.parameters()).dtype  # StopIteration on a replica without parameters
        params = {k: 2 * v for k, v in self.inner.named_parameters()}
        return torch.func.functional_call(self.inner, params, (x.to(dtype),))


def test_a_replica_reads_the_parameters_the_module_has():
    """Was: replicas > 0 had no parameters (torch's replicas have none): a StopIteration there."""
    torch.manual_seed(0)
    m = Probing().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 3)
    x = torch.randn(7, 3, dtype=DT)
    out = dp(x)
    torch.testing.assert_close(out, m(x))
    out.sum().backward()
    ref = copy.deepcopy(m)
    ref.zero_grad()
    ref(x).sum().backward()
    torch.testing.assert_close(m.inner.weight.grad, ref.inner.weight.grad)


def test_diffusers_unet_on_every_replica():
    """Was: UnboundLocalError in diffusers' dtype probe, on replicas >= 1 only (no parameters there)."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4,
    ).to(DT)  # fmt: skip
    dp = dpfast.DataParallel(unet, ["cpu"] * 3)
    x, t = torch.randn(5, 3, 8, 8, dtype=DT), torch.tensor([3] * 5)
    torch.testing.assert_close(dp(x, t).sample, unet(x, t).sample)


@pytest.mark.parametrize("mode", ["hooks", "ew"])
def test_opacus_per_sample_gradients_are_refused(mode):
    """Was (ew): grad_sample held replica 0's rows only (4 of 10), and a private step ended 2.2e-2 from the
    plain one, silently."""
    pytest.importorskip("opacus")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # opacus' notes about its modes
        from opacus.grad_sample.utils import wrap_model

        gsm = wrap_model(model, grad_sample_mode=mode)
    before = copy.deepcopy(model.state_dict())
    refusal = r"opacus' GradSampleModule\w*: its per-sample gradients.*Run it on one"
    with pytest.raises(TypeError, match=refusal):  # the constructor refuses it
        dpfast.DataParallel(gsm, ["cpu"] * 3)
    dp = dpfast.DataParallel(gsm, ["cpu"])
    dp.device_ids = ["cpu"] * 3  # made several devices afterwards: plan() and the call refuse it alike
    for what in (dp.plan, dp):
        with pytest.raises(TypeError, match=refusal):
            what(torch.randn(10, 3))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(getattr(p, "grad_sample", None) is None for p in model.parameters())
    dpfast.DataParallel(gsm, ["cpu"])(torch.randn(10, 3))  # one device: no replicas, opacus as usual


class Rewiring(nn.Module):
    """An LSTM (its ``_flat_weights`` list tracks the parameters) and a forward that, on a replica, assigns one of
    the LSTM's weights (an RNN's ``__setattr__`` writes it into that list in place), replaces a Linear's weight and
    deletes another entry, once its output is computed: what a call put into a replica's parameter slots must hold
    at the next call all the same."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.out = nn.Linear(4, 2)
        self.home = [id(self)]  # (a list: shared with the copies, which are other objects)

    def forward(self, x):
        y = self.out(self.rnn(x)[0][:, -1])
        if id(self) != self.home[0]:  # a replica: its own slots, undone before the next call
            self.rnn.weight_hh_l0 = nn.Parameter(torch.zeros_like(self.rnn.weight_hh_l0))
            self.out.weight = nn.Parameter(torch.zeros_like(self.out.weight))
            del self.rnn._parameters["bias_hh_l0"]
        return y


def _check_calls(dp, m, calls, exact_grads=True):
    """Each call of ``dp`` equals the module run on each half, forward and backward (gradients summed from copies
    may round otherwise: ``exact_grads=False``), with an optimizer-like in-place update between calls."""
    for i in range(calls):
        x = torch.randn(6, 5, 3, dtype=DT, generator=torch.Generator().manual_seed(i))
        out = dp(x)
        m.zero_grad()
        out.sum().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        ref = torch.cat([m(x[:3]), m(x[3:])])
        ref.sum().backward()
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for g, p in zip(grads, m.parameters()):
            torch.testing.assert_close(g, p.grad, **({"rtol": 0, "atol": 0} if exact_grads else {}))
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01)


def test_a_replica_sharing_the_module_device_is_written_and_undone_every_call(monkeypatch):
    """A replica on the module's own device is given the module's very parameters at every call, and what a
    forward changed in its slots (an LSTM's ``_flat_weights`` included) is undone before the next, so every call
    equals the module run on each half; undone, it holds none of them."""
    from dpfast.run import replica_copies

    writes = []
    write_params = replica_copies.Replica._write_params
    monkeypatch.setattr(replica_copies.Replica, "_write_params", lambda r, p: writes.append(1) or write_params(r, p))
    torch.manual_seed(0)
    m = Rewiring().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 2)
    _check_calls(dp, m, 5)
    assert len(writes) == 5 and dp._replicas.builds == 1
    (rs,) = dp._replicas._sets
    (replica,) = rs.replicas.values()
    replica.undo()  # (as the next call does first)
    assert list(replica.root.parameters()) == []


def test_a_replica_whose_parameters_are_copies_then_the_module_s_again(monkeypatch):
    """A replica given copies (the test switch: as if on another device) after the module's own parameters, and
    then the module's again: each call writes and undoes what it was given, never restoring an earlier call's."""
    from dpfast.run import replicas

    torch.manual_seed(0)
    m = Rewiring().to(DT)
    dp = dpfast.DataParallel(m, ["cpu"] * 2)
    for copies in (False, True, False, False, True):
        monkeypatch.setattr(replicas, "_COPY_ON_SOURCE_DEVICE", copies)
        _check_calls(dp, m, 2, exact_grads=not copies)
