"""``dpfast.nn``: recurrent layers whose state can be batch-first, and :class:`SyncBatchNorm` (which
batch-normalizes over the whole batch across replicas or ranks; defined in the run stage, ``run/sync_batchnorm.py``).

The recurrent layers exist so that ``dim=0`` data parallelism splits their state correctly.

``torch.nn.LSTM``/``GRU``/``RNN`` keep their state as ``(num_layers * num_directions, B, H)`` even with
``batch_first=True``. ``torch.nn.DataParallel`` (and ``dpfast.DataParallel`` with its default ``dim=0``) then splits
the *layer* axis of the state and the call fails or is wrong. Users work around it with
``h.permute(1, 0, 2).contiguous()`` before and after every call. These subclasses do that conversion for them, with
the fused :func:`dpfast.ops.state_to_layer_first` / :func:`dpfast.ops.state_to_batch_first` (h and c together, one
launch), when constructed with ``state_batch_first=True``.

Layout with ``state_batch_first=True``:

* batched input (3-D tensor, or a ``PackedSequence``): the initial state argument and the returned state are
  ``(B, num_layers * num_directions, H_out)``; for the LSTM ``h`` is ``(B, L*D, proj_size or hidden_size)`` and
  ``c`` is ``(B, L*D, hidden_size)``. With a ``PackedSequence`` the state's batch axis is in the caller's (unsorted)
  order, exactly as in torch, which permutes the layer-first state along its batch axis by ``sorted_indices``.
* unbatched input (2-D tensor): torch's state is then ``(L*D, H_out)`` and has no batch axis, so there is nothing to
  move; the state is passed and returned unchanged (the same layout as torch's).

Everything else (``batch_first``, ``proj_size``, bidirectional, a missing initial state, parameters and state dict
keys) is torch's own: the modules add no parameters or buffers, so state dicts load both ways unchanged.
With ``state_batch_first=False`` (the default) ``forward`` is torch's ``forward``.

``torch.compile``: Dynamo treats these as it treats torch's RNN modules (they are ``RNNBase`` instances): a graph
break around the call unless ``torch._dynamo.config.allow_rnn = True``, with which the whole forward, state
conversions included, traces under ``fullgraph=True``.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from . import ops
from .run.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["LSTM", "GRU", "RNN", "SyncBatchNorm", "convert_sync_batchnorm"]

RNNInput = Union[Tensor, PackedSequence]
LSTMState = tuple[Tensor, Tensor]


class _StateBatchFirst:
    """Mixin over a ``torch.nn.RNNBase`` subclass: converts the state at the module boundary, nothing else."""

    state_batch_first: bool
    # Provided by torch.nn.RNNBase:
    num_layers: int
    bidirectional: bool
    batch_first: bool
    hidden_size: int
    proj_size: int

    def __init__(self, *args: Any, state_batch_first: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        # A plain attribute (not a buffer): the state dict stays exactly torch's.
        self.state_batch_first = bool(state_batch_first)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self.__dict__.setdefault("state_batch_first", False)  # objects pickled before the attribute existed

    def extra_repr(self) -> str:
        s = super().extra_repr()  # type: ignore[misc]
        return s + ", state_batch_first=True" if self.state_batch_first else s

    # ---- helpers ----

    @staticmethod
    def _batch_size(input: RNNInput, batch_first: bool) -> int | None:
        """The batch size of a batched input, ``None`` for an unbatched (2-D) one."""
        if isinstance(input, PackedSequence):
            return int(input.batch_sizes[0])
        if input.dim() == 3:
            return input.size(0 if batch_first else 1)
        return None  # 2-D is unbatched; anything else is left for torch to reject with its own message

    def _check_state(self, name: str, x: Any, batch: int, hidden: int, hidden_name: str) -> None:
        """Raise a RuntimeError naming the batch-first layout when ``x`` does not have it.

        Checked before conversion: torch's own check runs on the converted (layer-first) tensor and its message
        would describe a layout the caller never passed.
        """
        ld = self.num_layers * (2 if self.bidirectional else 1)
        expected = (batch, ld, hidden)
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a Tensor of shape {expected}, got {type(x).__name__}")
        if tuple(x.shape) != expected:
            # RuntimeError, as torch raises for a wrong hidden size, so existing handlers keep working.
            raise RuntimeError(
                f"{name} has shape {tuple(x.shape)} but state_batch_first=True expects "
                f"(B, num_layers*num_directions, {hidden_name}) = {expected}"
            )

    def _forward_batch_first(self, input: RNNInput, hx: Any) -> tuple[Any, Any]:
        batch = self._batch_size(input, self.batch_first)
        if batch is None:  # unbatched: the state has no batch axis, so it already is torch's layout
            return super().forward(input, hx)  # type: ignore[misc]
        if hx is not None:
            hx = self._state_in(hx, batch)
        output, state = super().forward(input, hx)  # type: ignore[misc]
        return output, ops.state_to_batch_first(state)

    def _state_in(self, hx: Any, batch: int) -> Any:  # overridden by LSTM for (h, c)
        h_out = self.proj_size if self.proj_size > 0 else self.hidden_size
        self._check_state("hx", hx, batch, h_out, "H")
        return ops.state_to_layer_first(hx)


class LSTM(_StateBatchFirst, torch.nn.LSTM):
    """``torch.nn.LSTM`` with ``state_batch_first``: ``(h, c)`` in and out as ``(B, L*D, H)`` when it is true.

    ``h`` is ``(B, num_layers * num_directions, proj_size or hidden_size)``, ``c`` is
    ``(B, num_layers * num_directions, hidden_size)``; both are converted in one fused launch. Unbatched (2-D) input
    keeps torch's ``(L*D, H)`` state unchanged. Parameters and state dict are torch's. See :mod:`dpfast.nn`.

    Args:
        *args: ``torch.nn.LSTM``'s positional arguments (``input_size``, ``hidden_size``, ``num_layers``, ...).
        state_batch_first: keep the state batch-first, ``(B, L*D, H)``, in and out (default ``False``: torch's
            ``(L*D, B, H)``, and ``forward`` is torch's).
        **kwargs: ``torch.nn.LSTM``'s keyword arguments (``batch_first``, ``bidirectional``, ``proj_size``,
            ``dropout``, ``device``, ``dtype``, ...).

    Raises:
        ValueError, TypeError: invalid arguments, as ``torch.nn.LSTM`` raises them (a ``dropout`` out of range, a
            ``proj_size`` not below ``hidden_size``...).
    """

    def forward(  # type: ignore[override]
        self, input: RNNInput, hx: LSTMState | None = None
    ) -> tuple[RNNInput, LSTMState]:
        """Run the LSTM over ``input``, as ``torch.nn.LSTM.forward`` does, the state in the module's layout.

        Args:
            input: ``(B, T, input_size)`` with ``batch_first``, else ``(T, B, input_size)``; a ``PackedSequence``;
                or an unbatched ``(T, input_size)``.
            hx: the initial ``(h, c)``, or ``None`` for zeros. With ``state_batch_first``: ``h`` is
                ``(B, L*D, proj_size or hidden_size)`` and ``c`` is ``(B, L*D, hidden_size)``; else torch's
                ``(L*D, B, ...)``. Unbatched input: torch's ``(L*D, ...)`` either way.

        Returns:
            ``(output, (h_n, c_n))``: ``output`` as torch returns it (a Tensor, or a ``PackedSequence`` for one),
            and the final state in the module's layout, as ``hx`` (batch-first with ``state_batch_first``; for a
            ``PackedSequence``, its batch axis in the caller's unsorted order, as torch's).

        Raises:
            TypeError: with ``state_batch_first=True``, ``hx`` is not a tuple ``(h, c)`` of two Tensors.
            RuntimeError: with ``state_batch_first=True``, ``h`` or ``c`` is not ``(B, L*D, H)`` for this input
                (the type torch raises for a wrong hidden size, so existing handlers keep working); and torch's
                own checks: an input whose last dim is not ``input_size``, a state of the wrong size.
            ValueError: the input is neither 2-D nor 3-D, or not of the weights' dtype (torch's checks).
        """
        if not self.state_batch_first:
            return super().forward(input, hx)
        return self._forward_batch_first(input, hx)

    def _state_in(self, hx: Any, batch: int) -> Any:
        if not (isinstance(hx, (tuple, list)) and len(hx) == 2):
            raise TypeError(
                f"LSTM expects hx as a tuple (h, c) of Tensors, got {type(hx).__name__}"
                + (f" of length {len(hx)}" if isinstance(hx, (tuple, list)) else "")
            )
        h, c = hx
        h_out = self.proj_size if self.proj_size > 0 else self.hidden_size
        self._check_state("hx[0] (h)", h, batch, h_out, "proj_size" if self.proj_size > 0 else "H")
        self._check_state("hx[1] (c)", c, batch, self.hidden_size, "H")
        return ops.state_to_layer_first((h, c))  # h and c in one launch


class GRU(_StateBatchFirst, torch.nn.GRU):
    """``torch.nn.GRU`` with ``state_batch_first``: ``h`` in and out as ``(B, num_layers * num_directions, H)``.

    Unbatched (2-D) input keeps torch's ``(L*D, H)`` state unchanged. Parameters and state dict are torch's. See
    :mod:`dpfast.nn`.

    Args:
        *args: ``torch.nn.GRU``'s positional arguments (``input_size``, ``hidden_size``, ``num_layers``, ...).
        state_batch_first: keep the state batch-first, ``(B, L*D, H)``, in and out (default ``False``: torch's
            ``(L*D, B, H)``, and ``forward`` is torch's).
        **kwargs: ``torch.nn.GRU``'s keyword arguments (``batch_first``, ``bidirectional``, ``dropout``,
            ``device``, ``dtype``, ...).

    Raises:
        ValueError, TypeError: invalid arguments, as ``torch.nn.GRU`` raises them (a ``dropout`` out of range, a
            ``hidden_size`` that is not a positive int...).
    """

    def forward(  # type: ignore[override]
        self, input: RNNInput, hx: Tensor | None = None
    ) -> tuple[RNNInput, Tensor]:
        """Run the GRU over ``input``, as ``torch.nn.GRU.forward`` does, the state in the module's layout.

        Args:
            input: ``(B, T, input_size)`` with ``batch_first``, else ``(T, B, input_size)``; a ``PackedSequence``;
                or an unbatched ``(T, input_size)``.
            hx: the initial hidden state, or ``None`` for zeros: ``(B, L*D, hidden_size)`` with
                ``state_batch_first``, else torch's ``(L*D, B, hidden_size)``; unbatched input: ``(L*D, hidden_size)``
                either way.

        Returns:
            ``(output, h_n)``: ``output`` as torch returns it (a Tensor, or a ``PackedSequence`` for one), and the
            final hidden state in the module's layout, as ``hx`` (batch-first with ``state_batch_first``; for a
            ``PackedSequence``, its batch axis in the caller's unsorted order, as torch's).

        Raises:
            TypeError: with ``state_batch_first=True``, ``hx`` is not a Tensor.
            RuntimeError: with ``state_batch_first=True``, ``hx`` is not ``(B, L*D, hidden_size)`` for this input
                (the type torch raises for a wrong hidden size, so existing handlers keep working); and torch's
                own checks: an input whose last dim is not ``input_size``, a state of the wrong size.
            ValueError: the input is neither 2-D nor 3-D, or not of the weights' dtype (torch's checks).
        """
        if not self.state_batch_first:
            return super().forward(input, hx)
        return self._forward_batch_first(input, hx)


class RNN(_StateBatchFirst, torch.nn.RNN):
    """``torch.nn.RNN`` (tanh/relu) with ``state_batch_first``: ``h`` in and out as ``(B, num_layers * D, H)``.

    Unbatched (2-D) input keeps torch's ``(L*D, H)`` state unchanged. Parameters and state dict are torch's. See
    :mod:`dpfast.nn`.

    Args:
        *args: ``torch.nn.RNN``'s positional arguments (``input_size``, ``hidden_size``, ``num_layers``,
            ``nonlinearity``, ...).
        state_batch_first: keep the state batch-first, ``(B, L*D, H)``, in and out (default ``False``: torch's
            ``(L*D, B, H)``, and ``forward`` is torch's).
        **kwargs: ``torch.nn.RNN``'s keyword arguments (``nonlinearity``, ``batch_first``, ``bidirectional``,
            ``dropout``, ``device``, ``dtype``, ...).

    Raises:
        ValueError, TypeError: invalid arguments, as ``torch.nn.RNN`` raises them (a ``dropout`` out of range, an
            unknown ``nonlinearity``...).
    """

    def forward(  # type: ignore[override]
        self, input: RNNInput, hx: Tensor | None = None
    ) -> tuple[RNNInput, Tensor]:
        """Run the RNN over ``input``, as ``torch.nn.RNN.forward`` does, the state in the module's layout.

        Args:
            input: as for :meth:`GRU.forward`.
            hx: the initial hidden state, or ``None`` for zeros, as for :meth:`GRU.forward`.

        Returns:
            ``(output, h_n)``, as :meth:`GRU.forward` returns them.

        Raises:
            TypeError, RuntimeError, ValueError: as :meth:`GRU.forward` raises them.
        """
        if not self.state_batch_first:
            return super().forward(input, hx)
        return self._forward_batch_first(input, hx)
