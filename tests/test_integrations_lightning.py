"""``dpfast.integrations.lightning.DataParallelStrategy``: a Lightning Fabric training loop on a CPU rehearsal trains
as the same loop on one device, with dpfast's specs; Fabric's checkpoints hold the plain module's keys."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("lightning")
from lightning.fabric import Fabric  # noqa: E402

import dpfast  # noqa: E402
from dpfast.integrations.lightning import DataParallelStrategy  # noqa: E402


class _Recurrent(nn.Module):
    """A GRU step with its state ``(layers, B, H)``: batch axis 1, the default spec splits it wrongly."""

    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 4, num_layers=2)
        self.head = nn.Linear(4, 2)

    def forward(self, x, h):
        out, h = self.gru(x, h)
        return self.head(out[-1]), h


def _train(fabric: Fabric, checkpoint, steps: int = 5) -> tuple[list[float], dict]:
    """The losses of ``steps`` SGD steps, and the model's state as Fabric saves it."""
    torch.manual_seed(0)
    model = _Recurrent()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Fabric's notes about its environment
        model, optimizer = fabric.setup(model, optimizer)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, h, y = torch.randn(6, 10, 3, generator=gen), torch.randn(2, 10, 4, generator=gen), torch.randn(10, 2)
        pred, _ = model(x, h)
        loss = nn.functional.mse_loss(pred, y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    fabric.save(checkpoint, {"model": model})
    return losses, torch.load(checkpoint)["model"]


def test_a_fabric_loop_on_a_rehearsal_trains_as_on_one_device(tmp_path):
    strategy = DataParallelStrategy(["cpu"] * 3, in_dims={"x": 1, "h": 1}, out_dims=(0, 1))
    rehearsal = Fabric(strategy=strategy)
    losses, state = _train(rehearsal, tmp_path / "dp.ckpt")
    assert isinstance(rehearsal.strategy, DataParallelStrategy)
    one_losses, one_state = _train(Fabric(accelerator="cpu", devices=1), tmp_path / "one.ckpt")
    torch.testing.assert_close(losses, one_losses, rtol=1e-5, atol=1e-6)
    assert list(state) == list(one_state)  # the plain module's keys: Fabric unwraps the wrapper
    for k in state:
        torch.testing.assert_close(state[k], one_state[k], rtol=1e-5, atol=1e-6)


def test_the_strategy_wraps_the_model_in_dpfast_with_its_settings():
    strategy = DataParallelStrategy(["cpu"] * 2, in_dims={"x": 1, "h": 1}, chunk_sizes=[1, 3])
    wrapper = strategy.setup_module(_Recurrent())
    assert isinstance(wrapper, dpfast.DataParallel)
    assert wrapper.chunk_sizes == [1, 3] and wrapper.in_dims == {"x": 1, "h": 1}
    plan = wrapper.plan(torch.randn(6, 8, 3), torch.randn(2, 8, 4))
    assert plan.sizes == [2, 6]


def test_without_devices_or_cuda_it_says_what_to_give():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the default is every visible GPU")
    with pytest.raises(ValueError, match=r"no device_ids and no CUDA device; give device_ids, e\.g\. \['cpu'\] \* 2"):
        DataParallelStrategy()
