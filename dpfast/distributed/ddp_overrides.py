"""torch DDP's forward steps as dpfast overrides them for a rank that has no rows or cannot run its part: it
keeps step with the others (:mod:`dpfast.distributed.keeping_step` says how), and DDP's buffer broadcast takes
the buffers of a rank that had rows.

:meth:`KeepingStepOverrides._ddp_forward` runs torch's forward steps (pre-forward, the module, post-forward) as
torch's ``forward`` runs them, without its profiler label (``record_function("DistributedDataParallel.forward")``:
two calls through ``torch.ops`` on every forward) unless a profiler is recording. It does so only where torch's
``forward`` uses exactly the names of those steps (read from its code at import, a check that cannot see steps
reordered: ``tests/test_distributed_ddp_forward.py`` compares the code itself); otherwise torch's ``forward`` runs.

:class:`KeepingStepOverrides` is a mixin of :class:`~dpfast.distributed.module.DistributedDataParallel`, placed
before torch's class so that ``super()`` reaches torch's methods; it uses the wrapper's ``_call``, ``_checks``,
``_bucket_check``, ``_gather`` and ``_exchange_sizes``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.autograd import profiler

from .agreement import EMPTY_REFUSED, GHOST_COUNTED, DistributedBatchError, StepRecord
from .keeping_step import replay, run_empty_share

# the names torch's DistributedDataParallel.forward uses: the steps _ddp_forward copies, and the label
_TORCH_FORWARD_NAMES = (
    "torch",
    "autograd",
    "profiler",
    "record_function",
    "_pre_forward",
    "_delay_all_reduce_all_params",
    "module",
    "forward",
    "_run_ddp_forward",
    "_post_forward",
)
# compiled code takes torch's forward, which dynamo and its DDP optimizer know (and the profiler checks below are
# calls dynamo cannot trace)
_compiling = torch.compiler.is_compiling
_profiler_on = getattr(torch._C._autograd, "_profiler_enabled", None)  # a profiler recording this thread
_TORCH_FORWARD_COPIED = (
    nn.parallel.DistributedDataParallel.forward.__code__.co_names == _TORCH_FORWARD_NAMES
    and _profiler_on is not None
    and hasattr(profiler, "_is_profiler_enabled")  # set by any torch.autograd.profiler.profile: a second check
)


class _ShareRefused(Exception):
    """Raised out of DDP's forward when a rank without rows could run neither its empty share nor a ghost."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class KeepingStepOverrides:
    """The steps of a rank without rows, or one that cannot run its part (a mixin of DistributedDataParallel)."""

    _call: Any
    _checks: Any
    _bucket_check: Any
    _rank: int

    def _keep_step(self, record: StepRecord, ran_forward: bool) -> Any:
        """This rank cannot run its part (``record`` says why): it issues the step's collectives anyway, with
        nothing to contribute, up to the check, where every rank raises."""
        if not ran_forward:
            self._call.share, self._call.pending_rows = None, None
            self._pre_forward()  # DDP's: buffer broadcast, bucket rebuild
            replay(self._checks.trace or [])
        log = self._call.log if ran_forward else None
        in_forward = bool(self._checks.trace) or bool(log is not None and log.entries)
        if self.gather_outputs:
            self._gather(None, failed=True)
        elif not torch.is_grad_enabled() or in_forward:  # where the others check (see _finish)
            self._checks.check_now()
        elif self.require_backward_grad_sync:
            if self._checks.sizes_exchanged:
                self._exchange_sizes(0)
            self._match_all_reduce_for_bwd_pass()  # DDP's shadow of a backward (its join uses it)
            if self.find_unused_parameters:
                self._match_unused_params_allreduce()
            self.reducer._push_all_rebuilt_params()
            assert self._bucket_check is not None
            self._bucket_check.read()
        raise DistributedBatchError(
            f"dpfast.DistributedDataParallel: rank {self._rank} cannot run its part of this step "
            f"({record.error_line()}); under no_sync() the other ranks raise at the next synchronized backward"
        ) from record.error

    def _ddp_forward(self, args: tuple, kwargs: dict) -> Any:
        """torch's DDP ``forward`` on this rank's share, entering its profiler label only while a profiler records
        (torch's own ``forward`` runs then, under ``torch.compile``, and where its code is not the one copied)."""
        if not _TORCH_FORWARD_COPIED or _compiling() or profiler._is_profiler_enabled or _profiler_on():
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        args, kwargs = self._pre_forward(*args, **kwargs)
        if self._delay_all_reduce_all_params:
            return self._post_forward(self.module.forward(*args, **kwargs))
        return self._post_forward(self._run_ddp_forward(*args, **kwargs))

    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Inside torch's DDP forward (between its pre- and post-forward): a rank without rows runs its empty
        share, or a ghost (see :mod:`dpfast.distributed.keeping_step`)."""
        empty, log = self._call.empty, self._call.log
        if empty is None or log is None:
            return super()._run_ddp_forward(*inputs, **kwargs)
        result = run_empty_share(super()._run_ddp_forward, self.module, empty, log, self.out_dims, self.dim)
        if result.status == EMPTY_REFUSED:
            trace = self._checks.trace or []
            replay(trace[len(log.entries) :])  # the rest of the step's collectives, so the others do not wait
            raise _ShareRefused(result.error)
        if result.status == GHOST_COUNTED:
            self._call.ghost_error = result.error
        return result.outputs

    def _sync_buffers(self) -> None:
        """DDP broadcasts the buffers from rank 0 at each forward. A rank that had no rows in the last checked
        forward (a ``chunk_sizes`` weight of 0) holds buffers its module never updated (BatchNorm statistics that
        would never move), so the first rank that had rows is the source, as ``DataParallel`` keeps the buffers
        of the first replica that had rows. It comes from a checked plan, so every rank picks the same; with
        ``check_batch=False`` rank 0 stays the source."""
        source = self._checks.buffer_source
        if source == 0 or self._join_config.enable:
            return super()._sync_buffers()
        with torch.no_grad(), contextlib.ExitStack() as stack:
            self._assign_modules_buffers()
            preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
            for b in self.modules_buffers if preserve else ():  # one tensor each: torch 2.4 takes no tuple
                stack.enter_context(preserve(b))
            self._sync_module_buffers(source)
