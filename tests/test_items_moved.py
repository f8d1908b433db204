"""Per-sample items under ``"items"`` that are objects with a ``.to(device)`` method (a PyG ``Data``) are moved to
their replica's device, as PyG's own DataParallel moves its batches, without moving the caller's objects."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfast


class Item:
    """Not a container dpfast knows: moved only by its own ``.to``, which records where it went."""

    def __init__(self, x, moved_to=None):
        self.x, self.moved_to = x, moved_to

    def to(self, device):
        return Item(self.x.to(device), moved_to=torch.device(device))


class PerItem(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, items):
        devices = [str(it.moved_to) for it in items]
        return torch.cat([self.lin(it.x).sum(0) for it in items]), devices


def test_items_with_a_to_method_are_moved_to_their_replica():
    """Was: passed by reference, never moved (on GPUs the replicas got the caller's CPU objects)."""
    m = PerItem()
    dp = dpfast.DataParallel(m, ["cpu"] * 3, in_dims={"items": "items"}, out_dims=(0, "items"))
    items = [Item(torch.randn(k + 1, 3)) for k in range(7)]
    out, devices = dp(items)
    assert devices == ["cpu"] * 7  # every item went through .to(its replica's device)
    assert all(it.moved_to is None for it in items)  # the caller's objects stayed as they were
    torch.testing.assert_close(out, torch.cat([m.lin(it.x).sum(0) for it in items]))


def test_pyg_data_items():
    geometric = pytest.importorskip("torch_geometric.data")

    class GraphSum(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, graphs):
            seen.extend(id(g) for g in graphs)
            return torch.stack([self.lin(g.x).sum(0) + g.edge_index.shape[1] for g in graphs])

    torch.manual_seed(0)
    graphs = [geometric.Data(x=torch.randn(n, 4), edge_index=torch.randint(0, n, (2, 2 * n))) for n in (3, 5, 2, 4, 6)]
    seen: list = []
    m = GraphSum()
    dp = dpfast.DataParallel(m, ["cpu"] * 2, in_dims={"graphs": "items"})
    out = dp(graphs)
    assert len(seen) == 5 and not {id(g) for g in graphs} & set(seen)  # each replica got its graphs moved (copies)
    torch.testing.assert_close(out, m(graphs))
