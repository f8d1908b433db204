"""A typed user script: what a user's code under ``mypy --strict`` does with dpfast. It must type-check without an
error (``tests/test_typing.py``, ``make typecheck``) and it runs (on the CPU: a 2-replica rehearsal).

It subclasses ``DataParallel``, calls the fused ops and their reference, the collectives inside ``forward``,
``dpfast.nn``, ``build_info()``, ``plan()``, catches ``ScatterError``, and uses ``dpfast.distributed``'s helpers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import dpfast
import dpfast.distributed


class Contrastive(nn.Module):
    """Negatives from the whole batch: every replica's embeddings, gathered inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.norm = dpfast.nn.SyncBatchNorm(3)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        z: Tensor = self.norm(self.proj(x)) * mask  # Module.__call__ is typed Any (torch's choice)
        everyone = dpfast.all_gather(z, dim=0)
        mean: Tensor = dpfast.all_reduce(z.sum(0), op="mean")
        first = dpfast.replica_index() == 0 and dpfast.replica_count() >= 1
        return (z @ everyone.T).logsumexp(1) + mean.sum() * float(first)


class LoggingDataParallel(dpfast.DataParallel):
    """A subclass, as users write them (HF Trainer, Lightning and PEFT find ``.module`` through isinstance)."""

    calls: int = 0

    def forward(self, *inputs: object, **kwargs: object) -> object:
        self.calls += 1
        return super().forward(*inputs, **kwargs)


def run_data_parallel() -> Tensor:
    model = Contrastive()
    dp = LoggingDataParallel(model, ["cpu"] * 2, in_dims={"mask": None}, out_dims=0)
    x, mask = torch.randn(6, 4), torch.ones(3)
    plan: dpfast.CallPlan = dp.plan(x, mask)
    assert "B = 6" in str(plan)
    out = dp(x, mask)
    assert isinstance(out, Tensor) and out.shape == (6,) and dp.calls == 1
    try:
        dpfast.DataParallel(model, ["cpu"] * 2).plan(x, mask)  # the mask split on dim 0 too
    except dpfast.ScatterError as exc:  # the seed's error, made readable
        assert "in_dims={'mask': None}" in str(exc)
    else:
        raise AssertionError("a mask without a batch axis must be a ScatterError without in_dims")
    return out


def run_ops() -> None:
    h, c = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    ht, ct = dpfast.ops.transpose01(h, c)
    state: tuple[Tensor, Tensor] = (ht, ct)
    back = dpfast.ops.state_to_layer_first(state)
    assert isinstance(back, tuple) and torch.equal(back[0], h)
    rows: list[list[Tensor]] = dpfast.ops.split_contiguous([h, c], 1, [2, 3])
    moved = dpfast.ops.scatter([h], 1, [2, 3], ["cpu", torch.device("cpu")])
    whole: Tensor = dpfast.ops.gather(moved[0], 1, "cpu")
    assert torch.equal(whole, dpfast.reference.gather(rows[0], 1, "cpu"))
    same: tuple[Tensor, ...] = dpfast.reference.transpose01(h)
    assert torch.equal(same[0], ht)
    first = dpfast.reference.state_to_batch_first(h)
    assert isinstance(first, Tensor)


def run_nn() -> Tensor:
    lstm = dpfast.nn.LSTM(4, 8, num_layers=2, batch_first=True, state_batch_first=True)
    x = torch.randn(3, 5, 4)
    out, (h, c) = lstm.forward(x)
    assert h.shape == (3, 2, 8) and c.shape == (3, 2, 8)
    gru = dpfast.nn.GRU(4, 8, state_batch_first=True)
    _, hg = gru.forward(x.transpose(0, 1), torch.zeros(3, 1, 8))
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    converted: nn.Module = dpfast.nn.convert_sync_batchnorm(model)  # the same Sequential, converted in place
    assert converted is model and isinstance(model[1], dpfast.nn.SyncBatchNorm)
    assert isinstance(out, Tensor)
    return hg


def report_build() -> str:
    info = dpfast.build_info()
    loaded: bool = info["extension_loaded"]
    torch_version: str = info["torch_version"]
    arch: str | None = info["cuda_arch_list"]
    return f"dpfast {info['dpfast_version']} on torch {torch_version}: extension {loaded}, arch {arch}"


def per_rank_loading() -> None:
    """dpfast.distributed's helpers (they need no process group when rank and world_size are given)."""
    rows: range = dpfast.distributed.shard_range(10, rank=1, world_size=3)
    assert list(rows) == [4, 5, 6]
    batch = {"x": torch.arange(10.0).reshape(10, 1), "table": torch.ones(2, 2)}
    mine = dpfast.distributed.shard_batch(batch, rank=0, world_size=2, in_dims={"table": None})
    assert mine["x"].shape == (5, 1)
    subset = dpfast.distributed.shard_dataset(list(range(7)), rank=2, world_size=3)
    assert len(subset) == 2


def make_distributed(model: nn.Module, local_rank: int) -> dpfast.DistributedDataParallel:
    """Under torchrun, after torch.distributed.init_process_group (not called here)."""
    return dpfast.DistributedDataParallel(
        model, device_ids=[local_rank], in_dims={"h": 1}, out_dims=(0, 0, 1), gather_outputs=True
    )


def main() -> None:
    run_data_parallel()
    run_ops()
    run_nn()
    per_rank_loading()
    print(report_build())


if __name__ == "__main__":
    main()
