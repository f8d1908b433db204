"""Ranks without rows, and ranks that cannot run their part: each keeps step with the others.

Every rank must issue the same collectives in a step (:mod:`dpfast.distributed.agreement`): DDP's gradient
all-reduce, and those the module calls in forward (``dpfast.nn.SyncBatchNorm``, ``dpfast.all_gather``...).
:class:`CollectiveLog` observes the latter (it is a :class:`dpfast.run.collectives.observe_process_group_collectives`)
so that a rank that cannot run its module can :func:`replay` them with nothing to contribute.

A rank with no rows runs an **empty share** (``B = 0`` along every mapped axis: Linear, convolutions, LSTM/GRU,
SyncBatchNorm... accept it and give exactly-zero gradients, and its collectives contribute nothing). If the module
refuses it, and the global batch is on every rank, it runs a **ghost** instead: the batch's first sample, whose
outputs count as nothing. The ghost must not change another rank's numbers, so the collectives the refused empty
share already issued are not issued again (the ghost gets their results), and if the ghost reaches one beyond
them its sample would be counted there: the step then fails on every rank (status ``GHOST_COUNTED``). The ghost
leaves this rank's buffers and random-number state as they were. If the ghost is refused too (local BatchNorm
refuses one sample), the rank replays the rest of the step's collectives and the step fails on every rank.

Collectives in forward have adjoints in backward (``dpfast.all_reduce``'s backward all-reduces too), so a ghost gets
the earlier collectives' results with their graph: its backward issues their adjoints, as every other rank's does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..run.collectives import all_gather, all_reduce, observe_process_group_collectives, observing
from ..trees.flatten import unflatten
from ..trees.specs import Leaf, Spec
from ..trees.walk import walk
from .agreement import StepRecord
from .disagreement import EMPTY_REFUSED, GHOST_COUNTED, OK, DistributedBatchError, error_line

Entry = tuple  # (kind, dim or op, shape, dtype, device) of one collective


class CollectiveLog(observe_process_group_collectives):
    """The process-group collectives of one forward, in order (see the module docstring); ``with log:`` observes
    them (one object a forward, not a log and an observer). It does not hold itself as its observer: that cycle
    would keep a ghost's results (tensors with their graphs) until a garbage collection."""

    def __init__(self, keep_results: bool = False) -> None:
        self.entries: list[Entry] = []
        self.keep_results = keep_results  # a rank without rows: a ghost may need them
        self.results: list[Tensor] = []
        self.replay_upto = 0  # in a ghost: the first calls get the recorded results, nothing is sent
        self.position = 0
        self.sent_in_attempt = 0

    def __enter__(self) -> None:
        self.token = observing(self)

    def restart(self) -> None:
        """Another attempt at the same forward (the ghost): what the earlier ones sent is not sent again."""
        self.replay_upto, self.position, self.sent_in_attempt = len(self.entries), 0, 0

    def __call__(self, kind: str, t: Tensor, arg: object, communicate: Callable[[], Tensor]) -> Tensor:
        i = self.position
        self.position += 1
        if i < self.replay_upto:
            return self.results[i]
        out = communicate()
        self.entries.append((kind, arg, tuple(t.shape), t.dtype, t.device))
        if self.keep_results:  # with its graph: the ghost's backward must issue this collective's backward too
            self.results.append(out)
        self.sent_in_attempt += 1
        return out


def replay(entries: Sequence[Entry]) -> None:
    """Issue ``entries`` (the collectives a checked forward issued) with nothing to contribute: zero rows to an
    all-gather, zeros to an all-reduce."""
    with torch.no_grad():
        for kind, arg, shape, dtype, device in entries:
            zeros = torch.zeros(shape, dtype=dtype, device=device)
            if kind == "all_gather":
                all_gather(zeros.narrow(arg, 0, 0), arg)
            else:
                all_reduce(zeros, arg)


class ZeroOut(torch.autograd.Function):
    """Zeros shaped like the input, with a zero gradient: keeps a ghost's graph connected while contributing 0."""

    @staticmethod
    def forward(ctx, x):
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g)


def zero_ghost_outputs(out: Any, out_dims: Spec, dim: int) -> Any:
    """A ghost's outputs counted as nothing: int-spec tensors cut to zero rows, the rest zeroed with a zero
    gradient (the graph still reaches the same parameters, so DDP's reducer sees them all)."""
    spec = dim if out_dims is None else out_dims
    leaves: list[Leaf] = []
    tdef, _, _ = walk(out, spec, "output", dim, out_dims is not None, "out_dims", leaves)
    values = []
    for leaf in leaves:
        v, s = leaf.value, leaf.spec
        if isinstance(v, Tensor):
            if isinstance(s, int) and v.dim() > 0 and -v.dim() <= s < v.dim():
                v = v.narrow(s % v.dim(), 0, 0)
            elif v.is_floating_point() or v.is_complex():
                v = ZeroOut.apply(v)
            else:
                v = torch.zeros_like(v)
        elif isinstance(v, numbers.Number) and isinstance(s, str):
            v = type(v)(0)
        values.append(v)
    return unflatten(tdef, values)


class _Snapshot:
    """A module's buffers and the random-number state, to put back after an attempt that must leave no trace."""

    def __init__(self, module: nn.Module, device: torch.device | None) -> None:
        self.buffers = [
            (owner, name, t, t.detach().clone())
            for owner in module.modules()
            for name, t in owner._buffers.items()
            if t is not None
        ]
        self.cuda = device if device is not None and device.type == "cuda" else None
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None

    def restore(self) -> None:
        preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
        with torch.no_grad():
            for owner, name, t, saved in self.buffers:
                owner._buffers[name] = t
                with preserve(t) if preserve else contextlib.nullcontext():  # the ghost's graph may hold t
                    t.copy_(saved)
        torch.set_rng_state(self.rng)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.cuda)


@dataclasses.dataclass
class EmptyShare:
    """How a rank with no rows runs: ``empty`` (its empty slice, or None when one cannot hold zero rows, as a
    PackedSequence) and ``ghost`` (the first sample of the global batch, or None with per-rank inputs)."""

    empty: tuple[tuple, dict] | None
    ghost: Callable[[], tuple[tuple, dict]] | None


@dataclasses.dataclass
class EmptyShareResult:
    outputs: Any
    status: int
    error: BaseException | None


def run_empty_share(
    run: Callable[..., Any], module: nn.Module, share: EmptyShare, log: CollectiveLog, out_dims: Spec, dim: int
) -> EmptyShareResult:
    """Run a rank's empty share through ``run`` (DDP's forward of the module), or the ghost when the module
    refuses it (see the module docstring)."""
    refused: BaseException = ValueError("an empty share cannot be built for these inputs")
    if share.empty is not None:
        try:
            return EmptyShareResult(run(*share.empty[0], **share.empty[1]), OK, None)
        except Exception as exc:  # noqa: BLE001 - any refusal of B = 0; a real bug fails the ghost below too
            refused = exc
    if share.ghost is None:
        return EmptyShareResult(None, EMPTY_REFUSED, refused)
    # what the refused empty share did up to its refusal stands (an accepted one would have done it too, e.g. a
    # SyncBatchNorm's running statistics from the whole batch); what the ghost does is undone
    snapshot = _Snapshot(module, next((p.device for p in module.parameters()), None))
    log.restart()
    try:
        args, kwargs = share.ghost()
        out = run(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return EmptyShareResult(None, EMPTY_REFUSED, _refusal(refused, exc))
    finally:
        snapshot.restore()
    out = zero_ghost_outputs(out, out_dims, dim)
    if log.sent_in_attempt:
        return EmptyShareResult(out, GHOST_COUNTED, _refusal(refused, None))
    return EmptyShareResult(out, OK, None)


def _refusal(empty: BaseException, ghost: BaseException | None) -> BaseException:
    text = f"the module refused an empty batch ({error_line(empty)})"
    if ghost is not None:
        text += f" and one sample ({error_line(ghost)})"
    err = RuntimeError(text)
    err.__cause__ = ghost or empty
    return err


class _ShareRefused(Exception):
    """Raised out of DDP's forward when a rank without rows could run neither its empty share nor a ghost."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class EmptyRankSteps:
    """torch DDP's steps as a rank without rows, or one that cannot run its part, runs them (a mixin of
    :class:`~dpfast.distributed.module.DistributedDataParallel`, placed before torch's class so that ``super()``
    reaches torch's methods; it uses the wrapper's ``_call``, ``_checks``, ``_bucket_check``, ``_gather`` and
    ``_exchange_sizes``). DDP's buffer broadcast takes the buffers of a rank that had rows."""

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
        elif (not torch.is_grad_enabled() or in_forward) and not self._join_config.enable:  # as _finish does
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

    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Inside torch's DDP forward (between its pre- and post-forward): a rank without rows runs its empty
        share, or a ghost (see the module docstring)."""
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
