"""Memory format through scatter and gather: a ``channels_last`` (or ``channels_last_3d``) input reaches every replica
in that format and the gathered output keeps the format the replicas returned, as torch keeps it, with the bytes
moved exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfast

pytestmark = pytest.mark.usefixtures("one_thread")

CL = {4: torch.channels_last, 5: torch.channels_last_3d}


class Echo(nn.Module):
    """Returns its input as is (so the gather sees the replicas' own chunks) and records their layout."""

    def __init__(self):
        super().__init__()
        self.formats: list = []

    def forward(self, x):
        self.formats.append(
            (x.is_contiguous(), x.is_contiguous(memory_format=CL.get(x.dim(), torch.contiguous_format)))
        )
        return x


@pytest.mark.parametrize("shape", [(7, 3, 4, 5), (5, 2, 3, 4, 3)])
@pytest.mark.parametrize("axis", [0, 2])
def test_channels_last_in_is_channels_last_in_every_replica_and_out(shape, axis):
    fmt = CL[len(shape)]
    x = torch.randn(shape).contiguous(memory_format=fmt)
    m = Echo()
    out = dpfast.DataParallel(m, ["cpu"] * 3, in_dims=axis, out_dims=axis)(x)
    assert m.formats[-3:] == [(False, True)] * 3  # was (True, False): contiguous chunks
    assert out.is_contiguous(memory_format=fmt) and not out.is_contiguous()
    assert torch.equal(out, x)  # bit-exact (no value is touched on the way)
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize(
    ("shape", "axis", "sizes"), [((1, 2, 2, 2), 1, [1, 1]), ((3, 2, 1, 2), 1, [1, 1]), ((1, 2, 2, 2, 2), 1, [1, 1])]
)
def test_channels_last_chunks_that_are_also_contiguous_gather_channels_last(shape, axis, sizes):
    """A chunk of one channel (or of 1x1 pixels) is contiguous in both formats; its strides still say NHWC, as they
    do to torch (torch.cat keeps it channels_last), and the gather reads them (found by tests/fuzz_structures.py)."""
    fmt = CL[len(shape)]
    x = torch.arange(float(torch.Size(shape).numel())).reshape(shape).contiguous(memory_format=fmt)
    assert not x.is_contiguous()
    out = dpfast.DataParallel(Echo(), ["cpu"] * len(sizes), in_dims=axis, out_dims=axis)(x)
    assert out.is_contiguous(memory_format=fmt) and torch.equal(out, x)
    assert out.stride() == x.stride()


def test_contiguous_in_stays_contiguous():
    x = torch.randn(6, 3, 4, 5)
    m = Echo()
    out = dpfast.DataParallel(m, ["cpu"] * 2)(x)
    assert m.formats[-2:] == [(True, False)] * 2
    assert out.is_contiguous() and torch.equal(out, x)


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1).double().to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.conv(x)


def test_conv_model_channels_last_matches_plain_module_with_gradients():
    torch.manual_seed(0)
    m = Conv()
    x1 = torch.randn(5, 3, 6, 6, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    x2 = x1.detach().clone(memory_format=torch.preserve_format)
    x1.requires_grad_(True)
    x2.requires_grad_(True)
    out = dpfast.DataParallel(m, ["cpu"] * 3)(x1)
    ref = m(x2)
    assert ref.is_contiguous(memory_format=torch.channels_last)
    assert out.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(ref)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
