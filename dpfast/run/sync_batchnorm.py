"""``dpfast.nn.SyncBatchNorm``: batch statistics over the whole batch, across a DataParallel call's replicas or a
process group's ranks (through :mod:`dpfast.run.collectives`); BatchNorm when there is nothing to sync with.

The statistics are two exact passes (the mean from the summed values and counts, then the variance from the
summed squared deviations), built from differentiable collectives, so the gradients are the full-batch ones and a
train step equals plain BatchNorm on the whole batch (up to the order of floating-point sums). Running statistics
are updated as BatchNorm updates them (unbiased variance over the whole batch); on the replicas other than
replica 0 those updates are discarded, as on other GPUs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .collectives import all_reduce, replica_count


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm1d/2d/3d`` whose training statistics span every replica (or rank) of the call.

    Same arguments, parameters, buffers and state-dict keys as the torch modules (state dicts load into and from
    them). Inputs of 2 or more dims, channels on dim 1. Convert a model with :meth:`convert_sync_batchnorm`.

    Under ``dpfast.DataParallel`` a train step equals plain BatchNorm on the whole batch (outputs, gradients,
    running statistics, ``num_batches_tracked``); under ``torch.distributed`` the statistics span the process
    group's ranks; called directly, or in eval mode, it is BatchNorm.

    Args:
        num_features: ``C``, the number of channels (dim 1 of the input).
        eps: added to the variance for numerical stability.
        momentum: the running statistics' update factor; ``None`` for a cumulative average.
        affine: learn a per-channel ``weight`` and ``bias``.
        track_running_stats: keep ``running_mean``/``running_var`` (and use them in eval mode).
        device: where the parameters and buffers are made.
        dtype: their dtype.
        bias: keyword-only, where torch's BatchNorm takes it: with ``affine``, learn the bias too (``False``: the
            weight only).

    Raises:
        TypeError, ValueError: invalid arguments, as torch's ``BatchNorm`` raises them.
    """

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm: expected an input of 2 or more dims (N, C, ...), got {input.dim()}D "
                f"{tuple(input.shape)}"
            )

    def forward(self, input: Tensor) -> Tensor:
        """Batch-normalize ``input`` over the whole batch: in training, every replica's (or rank's) samples.

        Every replica (or rank) of the call must call it, in the same order (it is a collective in training).

        Args:
            input: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``.

        Returns:
            The normalized input, of its shape and dtype. In training the running statistics are updated as
            BatchNorm updates them (on replicas other than replica 0 those updates are discarded, as on other GPUs).

        Raises:
            ValueError: ``input`` has fewer than 2 dims, or (in training, on the CPU) the whole batch holds only
                one value per channel.
            dpfast.CollectiveError: the replicas of a ``DataParallel`` call disagree (different channel counts or
                dtypes), or one of them did not reach this collective.
        """
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not self.training or replica_count() == 1:  # torch's SyncBatchNorm syncs in training only, too
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight,
                self.bias,
                use_batch_stats,
                factor,
                self.eps,
            )
        return self._synced(input, factor)

    def _synced(self, input: Tensor, factor: float) -> Tensor:
        dims = [0] + list(range(2, input.dim()))
        shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
        local_count = input.numel() // max(input.shape[1], 1)
        # statistics in float32 at least, as torch's batch norm accumulates them (a float16 sum overflows at 65504)
        x = input.to(torch.promote_types(input.dtype, torch.float32))
        # one collective for the sums and the count together, one for the squared deviations
        stats = all_reduce(torch.cat([x.sum(dims), x.new_tensor([local_count])]), "sum")
        total, count = stats[:-1], stats[-1]
        if input.device.type == "cpu" and count.item() <= 1:  # (on a GPU this check would cost a host sync)
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training, got {int(count.item())} "
                "over the whole batch"
            )
        mean = total / count
        centered = x - mean.reshape(shape)
        var = all_reduce((centered * centered).sum(dims), "sum") / count
        out = centered * torch.rsqrt(var + self.eps).reshape(shape)
        if self.weight is not None:
            out = out * self.weight.reshape(shape)
        if self.bias is not None:  # torch's BatchNorm(..., bias=False) has a weight and no bias
            out = out + self.bias.reshape(shape)
        out = out.to(input.dtype)  # as BatchNorm returns the input's dtype, whatever its parameters' dtype
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach().to(self.running_var.dtype), alpha=factor)
        return out

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module) -> nn.Module:
        """``module`` with every BatchNorm1d/2d/3d (and torch's SyncBatchNorm) replaced by a dpfast
        SyncBatchNorm holding the same parameters and buffers.

        Args:
            module: a model, or a single BatchNorm module.

        Returns:
            ``module`` itself, its BatchNorm submodules replaced in place; a new SyncBatchNorm when ``module`` is
            itself a BatchNorm. The new modules share the old ones' ``Parameter`` and buffer tensors (no copy),
            and keep their training mode.

        Raises:
            Nothing of its own: modules other than BatchNorm are left as they are.
        """
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                device=_device_of(module),
            )
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child))
        return out


def _device_of(module: nn.Module) -> torch.device | None:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return None


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Every BatchNorm1d/2d/3d of ``module`` (and torch's SyncBatchNorm) becomes a dpfast :class:`SyncBatchNorm`
    holding the same parameters and buffers: :meth:`SyncBatchNorm.convert_sync_batchnorm`.

    Args:
        module: a model, or a single BatchNorm module.

    Returns:
        ``module`` itself, its BatchNorm submodules replaced in place; a new SyncBatchNorm when ``module`` is itself
        a BatchNorm.

    Raises:
        Nothing of its own: modules other than BatchNorm are left as they are.
    """
    return SyncBatchNorm.convert_sync_batchnorm(module)
