"""The parameter broadcast to replicas on other GPUs: copies for the targets only, gradients summed from the
targets only (torch's Broadcast also returned the source's copies, whose gradients autograd filled with zeros).

On the CPU the CUDA broadcast is replaced by clones, which runs the same autograd function and gradient sum.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.cuda import comm

import dpfast
from dpfast.move import broadcast as _broadcast

CPU = torch.device("cpu")


@pytest.fixture
def fake_comm(monkeypatch):
    """torch.cuda.comm.broadcast_coalesced on the CPU: the inputs for the source, clones for the others."""
    calls = []

    def broadcast_coalesced(tensors, devices):
        calls.append(len(devices))
        return [list(tensors)] + [[t.clone() for t in tensors] for _ in devices[1:]]

    monkeypatch.setattr(comm, "broadcast_coalesced", broadcast_coalesced)
    return calls


def test_copies_for_the_targets_only_and_their_gradients_summed(fake_comm):
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float32, requires_grad=True)
    frozen = torch.randn(2)
    rows = _broadcast.broadcast_to_others([w, b, frozen], CPU, [CPU, CPU])
    assert fake_comm == [3]  # one broadcast: the source and two targets
    assert len(rows) == 2 and all(len(r) == 3 for r in rows)
    assert [t.requires_grad for t in rows[0]] == [True, True, False]
    loss = sum((r[0] * (j + 1)).sum() + (r[1] * r[1]).sum() + r[2].sum() for j, r in enumerate(rows))
    loss.backward()
    assert torch.equal(w.grad, torch.full_like(w, 3.0))  # 1 + 2: one gradient per target, no source row
    assert torch.allclose(b.grad, 4 * b.detach())
    assert frozen.grad is None


def test_double_backward_through_the_sum(fake_comm):
    w = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (c1,), (c2,) = _broadcast.broadcast_to_others([w], CPU, [CPU, CPU])
    (g,) = torch.autograd.grad((c1**3).sum() + (c2**2).sum(), w, create_graph=True)
    assert torch.allclose(g, 3 * w**2 + 2 * w)
    (gg,) = torch.autograd.grad(g.sum(), w)
    assert torch.allclose(gg, 6 * w + 2)


def test_sum_onto_groups_by_dtype_and_keeps_shapes():
    rows = [
        [torch.ones(2, 3), torch.full((4,), 2.0, dtype=torch.float64), torch.ones(1, dtype=torch.float16)],
        [torch.ones(2, 3), torch.full((4,), 3.0, dtype=torch.float64), torch.ones(1, dtype=torch.float16)],
    ]
    out = _broadcast.sum_onto(CPU, rows, [True, True, False])
    assert torch.equal(out[0], torch.full((2, 3), 2.0)) and out[0].dtype == torch.float32
    assert torch.equal(out[1], torch.full((4,), 5.0, dtype=torch.float64))
    assert out[2] is None
    sparse = [[torch.eye(3).to_sparse()], [torch.eye(3).to_sparse()]]
    assert torch.equal(_broadcast.sum_onto(CPU, sparse, [True])[0].to_dense(), 2 * torch.eye(3))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_replicas_on_two_gpus_sum_gradients_without_a_source_copy():
    torch.manual_seed(0)
    src = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double().cuda(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double().cuda(0)
    ref.load_state_dict(src.state_dict())
    x = torch.randn(10, 8, dtype=torch.float64, device="cuda:0")
    for _ in range(2):  # the second step reuses the persistent replicas
        dpfast.DataParallel(src, device_ids=[0, 1])(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
    for p, q in zip(src.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad)
