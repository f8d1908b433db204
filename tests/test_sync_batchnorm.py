"""dpfast.nn.SyncBatchNorm: a train step under DataParallel equals plain BatchNorm on the full batch (outputs,
gradients, running statistics, num_batches_tracked, uneven splits included); in eval and called directly it is
BatchNorm; state dicts load into and from torch's BatchNorm. (Under DistributedDataParallel: test_distributed.py.)"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dpfast
from dpfast.nn import SyncBatchNorm, convert_sync_batchnorm

from dp_testing import DT


class ConvNet(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4, momentum=momentum)
        self.conv2 = nn.Conv2d(4, 5, 3)
        self.bn2 = nn.BatchNorm2d(5, momentum=momentum)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(5 * 4 * 4, 6), nn.BatchNorm1d(6, momentum=momentum))

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x)


def _loss(out):
    return (out * torch.arange(out.numel(), dtype=DT, device=out.device).reshape(out.shape).cos()).sum()


def _assert_buffers_equal(a, b):
    for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):
        torch.testing.assert_close(x, y, msg=lambda m, name=name: f"buffer {name}: {m}")


@pytest.mark.parametrize("n, batch", [(2, 8), (3, 7), (4, 9)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_train_steps_equal_full_batch_batchnorm(n, batch, momentum, device):
    torch.manual_seed(0)
    plain = ConvNet(momentum).to(DT).to(device)
    synced = convert_sync_batchnorm(copy.deepcopy(plain))
    assert sum(isinstance(m, SyncBatchNorm) for m in synced.modules()) == 3
    dp = dpfast.DataParallel(synced, [device] * n)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_s = torch.optim.SGD(synced.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(batch, 3, 6, 6, dtype=DT, device=device)
        out_p, out_s = plain(x), dp(x)
        torch.testing.assert_close(out_s, out_p)
        opt_p.zero_grad()
        opt_s.zero_grad()
        _loss(out_p).backward()
        _loss(out_s).backward()
        for (name, p), (_, q) in zip(plain.named_parameters(), synced.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
        opt_p.step()
        opt_s.step()
        _assert_buffers_equal(synced, plain)
    assert synced.bn1.num_batches_tracked.item() == 3
    plain.eval()
    synced.eval()
    x = torch.randn(5, 3, 6, 6, dtype=DT, device=device)
    torch.testing.assert_close(dp(x), plain(x))


def test_called_directly_and_in_eval_it_is_batchnorm():
    torch.manual_seed(1)
    bn = nn.BatchNorm1d(3).to(DT)
    sync = convert_sync_batchnorm(copy.deepcopy(bn))
    for shape in ((6, 3), (6, 3, 4)):
        x = torch.randn(*shape, dtype=DT)
        torch.testing.assert_close(sync(x), bn(x))
    _assert_buffers_equal(sync, bn)
    bn.eval()
    sync.eval()
    x = torch.randn(4, 3, dtype=DT)
    torch.testing.assert_close(sync(x), bn(x))


def test_state_dicts_load_into_and_from_torch_batchnorm():
    torch.manual_seed(2)
    torch_bn = nn.BatchNorm3d(4)
    torch_bn(torch.randn(3, 4, 2, 2, 2))  # some running statistics
    sync = SyncBatchNorm(4)
    sync.load_state_dict(torch_bn.state_dict())
    assert list(sync.state_dict()) == list(torch_bn.state_dict())
    back = nn.BatchNorm3d(4)
    back.load_state_dict(sync.state_dict())
    for k, v in torch_bn.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)


def test_convert_keeps_the_very_parameters_and_buffers():
    net = ConvNet()
    weight, mean = net.bn1.weight, net.bn1.running_mean
    converted = convert_sync_batchnorm(net)
    assert converted.bn1.weight is weight and converted.bn1.running_mean is mean
    assert isinstance(convert_sync_batchnorm(nn.BatchNorm2d(3)), SyncBatchNorm)


def test_one_value_per_channel_over_the_whole_batch_is_refused():
    dp = dpfast.DataParallel(SyncBatchNorm(2), ["cpu"] * 2)
    dp(torch.randn(2, 2))  # one sample per replica, two over the batch: fine
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        dpfast.DataParallel(SyncBatchNorm(2), ["cpu"] * 2)(torch.randn(1, 2))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_keep_float32_statistics_and_their_dtype(dtype):
    """Statistics accumulate in float32 at least (a float16 sum overflowed into NaN); the output has the input's
    dtype, as BatchNorm's does, also with float32 parameters (autocast's mix)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4)
    x = (torch.randn(64, 4) * 30 + 1000).to(dtype)  # the sums pass float16's 65504
    sync = convert_sync_batchnorm(copy.deepcopy(bn))
    out = dpfast.DataParallel(sync, ["cpu"] * 2)(x)
    ref = bn(x)
    assert out.dtype == ref.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(sync.running_mean, bn.running_mean, atol=0.5, rtol=1e-3)


def test_eval_without_running_stats_does_not_sync():
    """Like torch's SyncBatchNorm: in eval it never syncs, so ranks or replicas may evaluate alone."""
    bn = SyncBatchNorm(3, track_running_stats=False).eval()
    x = torch.randn(6, 3)
    out = dpfast.DataParallel(bn, ["cpu"] * 2)(x)
    expected = torch.cat([nn.functional.batch_norm(c, None, None, training=True) for c in x.split(3)])
    torch.testing.assert_close(out, expected)


_HAS_BIAS_FLAG = "bias" in __import__("inspect").signature(nn.BatchNorm1d.__init__).parameters


@pytest.mark.skipif(not _HAS_BIAS_FLAG, reason="this torch's BatchNorm has no bias= flag")
def test_batchnorm_without_bias_trains_as_full_batch(device):
    """``BatchNorm(..., bias=False)`` (a weight and no bias), converted or built directly, in a synced step."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, bias=False)).to(DT).to(device)
    for synced in (convert_sync_batchnorm(copy.deepcopy(plain)), None):
        if synced is None:
            synced = copy.deepcopy(plain)
            synced[1] = SyncBatchNorm(4, bias=False, device=device, dtype=DT)
            synced[1].load_state_dict(plain[1].state_dict())
        assert synced[1].weight is not None and synced[1].bias is None
        dp = dpfast.DataParallel(synced, [device] * 3)
        x = torch.randn(7, 3, dtype=DT, device=device)
        out_p, out_s = plain(x), dp(x)
        torch.testing.assert_close(out_s, out_p)
        _loss(out_p).backward()
        _loss(out_s).backward()
        for p, s in zip(plain.parameters(), synced.parameters()):
            torch.testing.assert_close(s.grad, p.grad)
            s.grad = p.grad = None
        _assert_buffers_equal(plain, synced)
        plain.load_state_dict(synced.state_dict())
