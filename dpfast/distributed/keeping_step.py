"""A rank without rows, or one that cannot run its part, keeps step with the others.

Every rank must issue the same collectives in a step (:mod:`dpfast.distributed.checks`): DDP's gradient
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
from .agreement import EMPTY_REFUSED, GHOST_COUNTED, OK, error_line
from .exchanges import ZeroOut

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
