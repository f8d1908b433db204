"""Lightning Fabric on dpfast: :class:`DataParallelStrategy` wraps the model in :class:`dpfast.DataParallel`.

Lightning's ``Trainer`` (2.6) no longer offers a DataParallel strategy; Fabric's ``DataParallelStrategy`` does, with
``torch.nn.DataParallel`` and no way to give it specs. This strategy is Fabric's with dpfast's wrapper: the same
devices, plus ``in_dims``, ``out_dims``, ``chunk_sizes``, ``dim`` and ``cost``. ``["cpu"] * 4`` rehearses a
4-device run on the CPU. Importing this module imports Lightning; ``import dpfast`` never does.

    fabric = Fabric(strategy=DataParallelStrategy(["cpu"] * 2, in_dims={"h": 1}))
    model, optimizer = fabric.setup(model, optimizer)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
from lightning.fabric.strategies import DataParallelStrategy as _FabricDataParallel
from torch import nn

from ..data_parallel import DataParallel, DeviceLike
from ..run.settings import check_given_device_ids, resolve_device
from ..trees.specs import Spec

__all__ = ["DataParallelStrategy"]


class DataParallelStrategy(_FabricDataParallel):
    """Fabric's data-parallel strategy on :class:`dpfast.DataParallel`: one process, a replica per device.

    Args:
        device_ids: the devices, as ``dpfast.DataParallel`` takes them (ints, ``"cuda:N"``, ``torch.device``,
            ``"cpu"``; repeats rehearse several devices on one). Default: every visible CUDA device.
        in_dims: the batch axis per input, as for ``dpfast.DataParallel``.
        out_dims: the gather axis or reduction per output, as for ``dpfast.DataParallel``.
        chunk_sizes: relative weights per device (default an even split).
        dim: the batch axis of what ``in_dims``/``out_dims`` do not name.
        cost: per-sample costs to balance, as for ``dpfast.DataParallel``.
        **kwargs: Fabric's own strategy arguments (``accelerator``, ``checkpoint_io``, ``precision``).

    Raises:
        ValueError: no ``device_ids`` and no CUDA device, or a device ``dpfast.DataParallel`` refuses.
        TypeError: a device of the wrong type.
    """

    def __init__(
        self,
        device_ids: Sequence[DeviceLike] | None = None,
        *,
        in_dims: Any = None,
        out_dims: Spec = None,
        chunk_sizes: Sequence[float] | None = None,
        dim: int = 0,
        cost: str | Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> None:
        check_given_device_ids(device_ids)
        if device_ids is None:
            if not torch.cuda.is_available():
                raise ValueError(
                    "DataParallelStrategy: no device_ids and no CUDA device; give device_ids, e.g. ['cpu'] * 2 to "
                    "rehearse two devices on the CPU"
                )
            device_ids = list(range(torch.cuda.device_count()))
        devices = [resolve_device(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
        super().__init__(parallel_devices=devices, **kwargs)
        self._wrapper_settings = {
            "in_dims": in_dims,
            "out_dims": out_dims,
            "chunk_sizes": chunk_sizes,
            "dim": dim,
            "cost": cost,
        }

    def setup_module(self, module: nn.Module) -> DataParallel:
        """Wrap ``module`` (on the first device) in :class:`dpfast.DataParallel` with this strategy's settings.

        Args:
            module: the model Fabric sets up.

        Returns:
            The ``dpfast.DataParallel`` wrapper over ``module``; Fabric's state-dict methods unwrap it as they
            unwrap ``torch.nn.DataParallel``.

        Raises:
            TypeError, ValueError: what ``dpfast.DataParallel``'s constructor raises for these settings.
        """
        assert self.parallel_devices is not None
        return DataParallel(module, device_ids=self.parallel_devices, **self._wrapper_settings)
