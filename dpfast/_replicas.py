"""One module per replica: the module itself on its own device, differentiable copies elsewhere.

A replica on the module's device *is* the module, so ``device_ids=["cpu"] * 4`` or ``[0, 0]`` runs the same module
object several times concurrently: a rehearsal of a multi-GPU run on one device. Replicas that share a device share
one module (like the inputs they get, a replica's state is never written back: see torch.nn.parallel.replicate).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
from torch import nn


def check_module_device(module: nn.Module, source: torch.device) -> None:
    """torch.nn.DataParallel's rule: parameters and buffers live on ``device_ids[0]``."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device != source:
            raise RuntimeError(
                f"module must have its parameters and buffers on device {source} (device_ids[0]) but found one of "
                f"them on device: {t.device}; move it there first (module.to({str(source)!r}))"
            )


def replicate(module: nn.Module, source: torch.device, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One module per entry of ``devices``: ``module`` on ``source``, one copy per other (CUDA) device.

    Copies are made by ``torch.nn.parallel.replicate``: parameters are broadcast with autograd, so gradients of
    every replica sum back onto the original parameters. Under ``no_grad`` they are detached copies.
    """
    others = []
    for d in devices:
        if d != source and d not in others:
            others.append(d)
    if not others:
        return [module] * len(devices)
    if source.type != "cuda" or any(d.type != "cuda" for d in others):
        raise ValueError(
            f"cannot copy a module on {source} to {', '.join(map(str, others))}: copies are made for CUDA devices "
            "only; use one device type in device_ids"
        )
    copies = nn.parallel.replicate(module, [source] + others, detach=not torch.is_grad_enabled())[1:]
    table = dict(zip(others, copies))
    return [module if d == source else table[d] for d in devices]
