"""dpfast.DistributedDataParallel on a GPU (marked ``cuda``: skipped without one; ``benchmarks/gpu_check.sh`` runs
it): a one-rank NCCL group, whose gradient buckets go through the check's Python comm hook
(dpfast/distributed/bucket_check.py). Its training step must not make the host wait for the GPU more than torch's
DDP does: no host-device sync in backward. Run in a subprocess, so the NCCL group lives and dies with it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dpfast

from ddp_harness import free_port

STEP_WITHOUT_HOST_SYNC = """
import os, torch, torch.distributed as dist, torch.nn.functional as F
import dpfast
from dpfast.distributed.bucket_check import BucketCheck
dist.init_process_group("nccl", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
ddp = dpfast.DistributedDataParallel(model, device_ids=[0])
assert isinstance(ddp._bucket_check, BucketCheck), type(ddp._bucket_check)  # CUDA buckets: the Python hook
x, y = torch.randn(64, 64, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
def step(synced):
    ddp.zero_grad(set_to_none=True)
    loss = F.cross_entropy(ddp(x), y)
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error" if synced else mode)
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
for _ in range(3):  # the first steps check at once, and DDP rebuilds its buckets: both synchronize
    step(False)
torch.cuda.synchronize()
for _ in range(3):
    step(True)
torch.cuda.synchronize()
ddp(x)  # the last backward's check, read at the next forward
dist.destroy_process_group()
print("OK")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="needs NCCL")
def test_a_training_step_makes_no_host_sync_in_backward(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(dpfast.__file__))] if p)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(STEP_WITHOUT_HOST_SYNC)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
