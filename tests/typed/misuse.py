"""Misuse that ``mypy --strict`` must report: each line marked ``# expect: <error code>`` must get exactly that
error, and no other line any (``tests/test_typing.py``). Never run."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import dpfast
import dpfast.distributed

x = torch.randn(4, 3)
model = nn.Linear(3, 2)

dpfast.DataParallel(model, ["cpu"] * 2, in_dimz={"x": 0})  # expect: call-arg
dpfast.DataParallel(model, chunk_sizes=2)  # expect: arg-type
dpfast.all_gather(x, dim="0")  # expect: arg-type
dpfast.all_reduce(x, op=2)  # expect: arg-type
dpfast.ops.transpose01([x, x])  # expect: arg-type
dpfast.ops.split_contiguous([x], 0, 4)  # expect: arg-type
dpfast.reference.gather([x], 0, device=1.5)  # expect: arg-type
dpfast.distributed.shard_range("10", rank=0, world_size=2)  # expect: arg-type
dpfast.build_info()["torch_versoin"]  # expect: typeddict-item
dpfast.DataParalel(model)  # expect: attr-defined
wrong: Tensor = dpfast.ops.split_contiguous([x], 0, [4])  # expect: assignment
