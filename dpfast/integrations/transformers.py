"""A Hugging Face ``transformers.Trainer`` whose model runs under :class:`dpfast.DataParallel`.

``DataParallelTrainer(model, args, ..., device_ids=["cpu"] * 4)`` trains exactly as the plain single-device
``Trainer`` does on the same global batch, whether Trainer believes it has one device (a CPU rehearsal, or one GPU
split into replicas) or several (``args.n_gpu > 1``, where the plain Trainer would use ``torch.nn.DataParallel``).
Importing this module imports transformers; ``import dpfast`` never does.

**The loss.** No fixed ``out_dims`` reduction is right for every model. A model that honours Trainer's
``num_items_in_batch`` (GPT-2: a token sum divided by the batch's token count) needs ``"sum"``; one that ignores it
(BERT: a mean over its own samples) needs a mean weighted by each replica's share of the batch; a token-averaged loss
needs the share of the *tokens*, not of the samples. And Trainer itself changes its arithmetic when it sees
``n_gpu > 1`` (it splits or tiles ``num_items_in_batch`` per GPU, multiplies the loss by ``n_gpu`` and averages
the per-GPU losses that torch's DataParallel stacks), which is why a reduction checked in a rehearsal was wrong on
the GPUs. So here each replica's items are counted as Trainer counts them (labels that are not ``-100``, shifted by
one for causal LMs, ``shift_labels`` when given), each replica gets its own count ``n_r`` as
``num_items_in_batch`` (when Trainer passes one), so its loss is a mean over its own items whether the model uses
the count or its own mean, and the replicas' losses are combined as ``sum_r loss_r * n_r / N``, with ``N``
Trainer's ``num_items_in_batch`` (the whole accumulated batch's count) or the batch's own count when Trainer passes
none. A replica without items adds nothing. Trainer's own loss and item-count arithmetic then runs as for one
device (``n_gpu`` reads 1 there); everything else (the batch size ``per_device_train_batch_size * n_gpu``) is as
Trainer sets it.

That is the single-device loss for a model that uses ``num_items_in_batch`` (whatever it counts), and for a model
whose own mean counts what Trainer counts (HF's losses do). One difference from the plain Trainer remains, with
gradient accumulation on a model that accepts ``**kwargs`` but ignores ``num_items_in_batch`` (BERT): the plain
Trainer then divides that model's loss neither by the accumulated count nor by the accumulation steps
(huggingface/transformers#47688); here it is divided by the accumulated count, as for a model that uses it, so the
accumulated steps equal the whole batch without accumulation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import transformers
from torch import Tensor, nn

from ..data_parallel import DataParallel, DeviceLike

__all__ = ["DataParallelTrainer"]

IGNORE_INDEX = -100  # what Trainer's item count and HF's losses leave out


class _ItemWeightedLoss(DataParallel):
    """DataParallel whose ``loss`` output is the whole batch's: each replica's loss over its own items, weighted by
    its share of the items. Through torch's ``scatter`` and ``gather`` hooks (the replicas stay dpfast's)."""

    def __init__(self, module: nn.Module, device_ids: Any, in_dims: Any, out_dims: Any, shifts_labels: bool):
        super().__init__(module, device_ids, in_dims=in_dims, out_dims=out_dims)
        self.shifts_labels = shifts_labels
        self._items: tuple[list[int], Any] | None = None  # this call's items per replica, and Trainer's total

    def plan(self, *inputs: Any, **kwargs: Any) -> Any:
        kwargs.pop("num_items_in_batch", None)  # never split: each replica gets its own count
        return super().plan(*inputs, **kwargs)

    def scatter(self, inputs: tuple, kwargs: dict | None, device_ids: Sequence[DeviceLike]) -> tuple[tuple, tuple]:
        kwargs = dict(kwargs or {})
        total = kwargs.pop("num_items_in_batch", None)
        args, kws = super().scatter(inputs, kwargs, device_ids)
        counts = [self._count(k) for k in kws]
        self._items = None if any(c is None for c in counts) else (counts, total)
        if total is not None and self._items is not None:
            # each replica divides its token sum by its own count (never 0: a replica without items has sum 0)
            dtype = total.dtype if isinstance(total, Tensor) else None
            kws = tuple(dict(k, num_items_in_batch=_scalar(max(c, 1), dtype, k)) for k, c in zip(kws, counts))
        elif total is not None:
            kws = tuple(dict(k, num_items_in_batch=total) for k in kws)
        return args, kws

    def _count(self, kwargs: dict) -> int | None:
        """A replica's number of items, as Trainer counts them; None without labels."""
        labels = kwargs.get("shift_labels")
        if labels is None:
            labels = kwargs.get("labels")
            if isinstance(labels, Tensor) and self.shifts_labels:
                labels = labels[..., 1:]
        if not isinstance(labels, Tensor):
            return None
        return int(labels.ne(IGNORE_INDEX).sum())

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        out = super().gather(outputs, output_device)
        losses = _loss_of(out)
        if losses is None or self._items is None:
            return out
        counts, total = self._items
        losses = losses.reshape(-1)
        if losses.numel() != len(counts):
            raise RuntimeError(
                f"DataParallelTrainer: the model returned a loss of shape {tuple(losses.shape)} per replica; it "
                "combines one scalar loss per replica"
            )
        n = torch.tensor(counts, device=losses.device)
        denominator = n.sum() if total is None else torch.as_tensor(total, device=losses.device)
        weights = n.to(losses.dtype) / denominator.to(losses.dtype)
        full = torch.where(n > 0, losses * weights, torch.zeros_like(losses)).sum()
        return _with_loss(out, full)


def _scalar(n: int, dtype: Any, kwargs: dict) -> Tensor:
    """``n`` as a 0-dim tensor on the replica's device (where its labels are)."""
    labels = kwargs.get("shift_labels", kwargs.get("labels"))
    return torch.tensor(n, dtype=dtype, device=labels.device if isinstance(labels, Tensor) else None)


def _loss_of(out: Any) -> Tensor | None:
    if isinstance(out, Mapping):
        loss = out.get("loss")
    elif isinstance(out, (tuple, list)) and out:
        loss = out[0]
    else:
        return None
    return loss if isinstance(loss, Tensor) and loss.dim() <= 1 else None


def _with_loss(out: Any, loss: Tensor) -> Any:
    if isinstance(out, Mapping):
        out["loss"] = loss
        return out
    return type(out)([loss, *out[1:]])


class _OneDeviceArgs:
    """TrainingArguments read as a single-device Trainer reads them (``n_gpu`` is 1); everything else passes."""

    n_gpu = 1

    def __init__(self, args: Any):
        object.__setattr__(self, "_args", args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)


class DataParallelTrainer(transformers.Trainer):
    """``transformers.Trainer`` on :class:`dpfast.DataParallel`: one line to change, the same training.

    Args:
        *args: ``transformers.Trainer``'s positional arguments (``model``, ``args``, ...).
        device_ids: the replicas' devices, as for ``dpfast.DataParallel`` (``["cpu"] * 4`` rehearses 4 GPUs on the
            CPU; ``[0] * 4`` on one GPU). Default ``None``: when Trainer sees several GPUs (``args.n_gpu > 1``),
            all of them; otherwise the model is not wrapped (the plain Trainer).
        in_dims: as for ``dpfast.DataParallel``, keyed by the model's ``forward`` parameters (Trainer calls it with
            keywords). Default: every input's batch is on axis 0.
        out_dims: as for ``dpfast.DataParallel``, for the outputs other than ``loss``, which this Trainer combines
            itself (see the module docstring). Default: every output is concatenated on axis 0.
        **kwargs: ``transformers.Trainer``'s keyword arguments (``model=``, ``args=``, ``train_dataset=``, ...).

    Raises:
        ValueError: ``out_dims`` is a single reduction, or names ``loss`` (this Trainer combines the loss itself).
        Exception: what ``transformers.Trainer``'s constructor raises for its own arguments.
    """

    def __init__(
        self,
        *args: Any,
        device_ids: Sequence[DeviceLike] | None = None,
        in_dims: Any = None,
        out_dims: Any = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(out_dims, str) or (isinstance(out_dims, Mapping) and "loss" in out_dims):
            raise ValueError(
                f"DataParallelTrainer got out_dims={out_dims!r}; it combines the loss itself (each replica's mean "
                "over its items, weighted by its share of the batch's items), so leave 'loss' out of out_dims"
            )
        self._dp_device_ids = None if device_ids is None else list(device_ids)
        self._dp_in_dims = in_dims
        self._dp_out_dims = out_dims
        self._dp: _ItemWeightedLoss | None = None
        super().__init__(*args, **kwargs)

    def _uses_dpfast(self) -> bool:
        return self._dp_device_ids is not None or self.args.n_gpu > 1

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if isinstance(model, DataParallel) or not self._uses_dpfast():
            return model if isinstance(model, DataParallel) else super()._wrap_model(model, training, dataloader)
        if self.accelerator.unwrap_model(model, keep_torch_compile=False) is not model:
            return model  # already wrapped by something else
        if self._dp is None or self._dp.module is not model:
            shifts = getattr(self, "_loss_shifts_labels", False)  # how Trainer counts a causal LM's items
            self._dp = _ItemWeightedLoss(model, self._dp_device_ids, self._dp_in_dims, self._dp_out_dims, shifts)
        return self._dp

    @contextlib.contextmanager
    def _one_device_view(self):
        """Trainer's loss arithmetic as for one device: with ``n_gpu > 1`` it would undo torch.nn.DataParallel's
        per-GPU stacking, which dpfast does not do (the wrapper returns the whole batch's loss)."""
        args = self.args
        if not self._uses_dpfast() or args.n_gpu <= 1:
            yield
            return
        self.args = _OneDeviceArgs(args)
        try:
            yield
        finally:
            self.args = args

    def compute_loss(
        self, model: nn.Module, inputs: dict, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """Trainer's ``compute_loss``, with Trainer's loss arithmetic as for one device (dpfast returns the whole
        batch's loss: there are no per-GPU losses to average).

        Args:
            model: the model (wrapped in dpfast's DataParallel when training on several replicas).
            inputs: the batch, as Trainer prepares it.
            return_outputs: return ``(loss, outputs)`` instead of the loss.
            num_items_in_batch: the accumulated batch's item count, as Trainer passes it.

        Returns:
            The loss, or ``(loss, outputs)``, as ``transformers.Trainer.compute_loss`` returns them.

        Raises:
            RuntimeError: the model returned a loss that is not one scalar per replica.
            Exception: what the model or Trainer raises.
        """
        with self._one_device_view():
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        with self._one_device_view():
            return super()._get_num_items_in_batch(batch_samples, device)
