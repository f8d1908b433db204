"""``dpfast.distributed.fully_shard``: torch's FSDP2 ``fully_shard`` with the specs and modes of
:class:`~dpfast.distributed.DistributedDataParallel`.

It applies torch's ``fully_shard`` to the module and gives the module's class one more level whose ``__call__``
runs around torch's (its forward hooks included), on every rank:

1. Plan the call by its call program, as ``DistributedDataParallel`` does (over ``world_size`` parts for the
   global batch, one part for per-rank inputs), and check that the ranks agree, **before** FSDP's forward hook:
   torch leaves FSDP's per-step state undefined after a raise that follows that hook, so a rank that disagrees
   must raise before it. The check is one small all-gather per forward (``check_batch=False`` skips it): FSDP2 has
   no collective ahead of its hook that could carry it, as DDP's first gradient bucket does, so FSDP's all-gather
   of the root's parameters (``unshard(async_op=True)``, which its hook then waits for) is started while the
   check's is in flight, and their round trips overlap. The check's buffers are on the host (over a gloo group of
   the same ranks where the mesh's backend is NCCL alone): the host reads its result at once, and reading a CUDA
   result would first wait for every kernel the last step queued. A group of one checks without a collective.
2. Run this rank's rows through torch's call (FSDP's all-gather, the module, its pre-backward hooks). A rank with
   no rows of the global batch runs a ghost at once: the batch's first sample, whose outputs and gradients count
   as nothing (:mod:`dpfast.distributed.empty_ranks`). Not its empty share first, as under DDP: a module that
   refuses an empty batch raises inside FSDP's hooks, and a second try then breaks the order of FSDP's
   collectives in backward (measured: a hang with the state fed back). With per-rank inputs it runs its empty
   share. Without ``gather_outputs``, a step in which some rank has no rows (every rank knows: the plan's sizes,
   or for per-rank inputs the row counts the check carried) ends with one more check, so that a rank that could
   not run its part raises on every rank (the others would wait in FSDP's backward). That holds when no FSDP
   all-gather of the forward follows the failure (the root alone): a failing rank cannot issue the all-gathers of
   torch-sharded blocks it never reached, so the others' then meet its check (gloo: a collective mismatch).
3. With ``gather_outputs=True``, the same output exchange as DDP's: every rank gets the full-batch outputs. FSDP2,
   like DDP, divides gradients by the world size before summing them, so the exchange's backward (the exact
   adjoint of an all-gather) gives the full-batch gradients (:mod:`dpfast.distributed.output_adjoint`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..ext.torch_compat import run_by_dynamo_as_it_is
from ..plan.costs import CostSource
from ..trees.binding import Binding
from .agreement import StepChecks, StepRecord, record_of
from .disagreement import EMPTY_REFUSED, GHOST_COUNTED, MODULE_RAISED, DistributedBatchError
from .empty_ranks import CollectiveLog, EmptyShare, run_empty_share
from .group import RankGroup
from .inputs import RankCall, plan_rank_call, rank_call, through_input_grads
from .output_layout import ExchangeLayouts
from .outputs import OutputsCall, gather_across_ranks
from .settings import agreed_settings

NAME = "dpfast.distributed.fully_shard"


def _torch_fully_shard() -> Callable[..., Any]:
    try:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
    except ImportError:  # torch < 2.6 keeps FSDP2 under a private name
        raise RuntimeError(
            f"{NAME} needs FSDP2 as torch.distributed.fsdp.fully_shard, which torch {torch.__version__} lacks: "
            "install torch>=2.6, or use dpfast.DistributedDataParallel"
        ) from None
    return torch_fully_shard


def _mesh_and_group(mesh: Any) -> tuple[Any, Any]:
    """The mesh for torch's ``fully_shard`` and the process group the batch is split over: ``mesh`` (default: all
    ranks on the process group's device; torch's own default follows whatever accelerator it finds, even where the
    process group is gloo's). A 2-D (HSDP) mesh replicates over one axis and shards over the other, and every one
    of its ranks is a data-parallel rank: the batch is split over all of them, which must be every rank."""
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        device = "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    ndim = getattr(mesh, "ndim", None)
    if ndim == 1:
        return mesh, mesh.get_group()
    if ndim == 2 and mesh.mesh.numel() == dist.get_world_size():
        return mesh, dist.group.WORLD
    what = f"{ndim} dimensions over {mesh.mesh.numel()} of {dist.get_world_size()} ranks" if ndim else repr(mesh)
    raise ValueError(
        f"mesh must be a DeviceMesh of one dimension, or of two (HSDP: replicated x sharded) over every rank, got "
        f"{what}; for another layout apply torch's fully_shard and split the batch with "
        "dpfast.distributed.shard_batch over the data-parallel ranks"
    )


def fully_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    in_dims: Any = None,
    out_dims: Any = None,
    dim: int = 0,
    inputs: str = "global",
    gather_outputs: bool = False,
    check_batch: Any = True,
    chunk_sizes: Sequence[float] | None = None,
    cost: Any = None,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """torch's FSDP2 ``fully_shard`` with dpfast's ``in_dims``/``out_dims`` and modes.

    Args:
        module: the root module. Blocks already passed to torch's ``fully_shard`` stay as they are.
        mesh: a one-dimensional ``DeviceMesh`` over the ranks, or a two-dimensional one over every rank (HSDP:
            replicated x sharded; the batch is split over all of them); ``None``: every rank, on the process
            group's device (``"cuda"`` for NCCL, else ``"cpu"``).
        in_dims: as for :class:`dpfast.distributed.DistributedDataParallel`.
        out_dims: as for ``DistributedDataParallel``.
        dim: as for ``DistributedDataParallel``.
        inputs: ``"global"`` (every rank is given the global batch and keeps its rows) or ``"per_rank"`` (every
            rank passes its own rows; shares may differ in size), as for ``DistributedDataParallel``.
        gather_outputs: every rank gets the full-batch outputs along ``out_dims``; a loss on them gives, after
            FSDP's gradient reduction, exactly the full-batch gradients. Without it, each rank's own outputs.
        check_batch: ``True`` (default): before each forward the ranks check that they agree (``B``, the split,
            the argument structure, shapes and dtypes; per-rank inputs: structure and dtypes), in one small
            all-gather. ``"values"`` also compares a hash of the split tensors' bytes; ``False`` skips it.
        chunk_sizes: as for ``DistributedDataParallel`` (``inputs="global"`` only): one relative weight per rank.
        cost: as for ``DistributedDataParallel`` (``inputs="global"`` only): balances the ranks' work.
        **fully_shard_kwargs: passed to torch's ``fully_shard`` (``reshard_after_forward``, ``mp_policy``, ...).

    Returns:
        ``module`` itself, now an ``FSDPModule`` (its ``state_dict`` keys unchanged), whose calls split, check and
        gather as the settings say.

    Raises:
        DistributedBatchError: on every rank, when the ranks were built with different settings (here), or when a
            forward finds that they disagree or that one cannot run its part.
        TypeError, ValueError: invalid settings (on every rank alike).
        RuntimeError: ``torch.distributed`` is not initialized, or this torch has no FSDP2.
    """
    torch_fully_shard = _torch_fully_shard()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{NAME} needs torch.distributed: call torch.distributed.init_process_group(...) first (torchrun sets "
            "the environment for it)"
        )
    values = dict(inputs=inputs, in_dims=in_dims, out_dims=out_dims, dim=dim, chunk_sizes=chunk_sizes)
    values.update(cost=cost, gather_outputs=bool(gather_outputs), check_batch=check_batch)
    mesh, pg = _mesh_and_group(mesh)

    from torch.distributed.fsdp import FSDPModule  # (there, as _torch_fully_shard found)

    def once_and_by_torch_signature() -> None:
        if isinstance(module, _ShardedCall):
            raise ValueError(f"{NAME} was already applied to this module: apply it once, to the root")
        if isinstance(module, FSDPModule):
            raise ValueError(
                f"torch's fully_shard was already applied to this module: apply {NAME} to the root instead (blocks "
                "inside it may stay torch's)"
            )
        try:  # (before torch registers anything on the module: a typo must not leave it half-sharded)
            inspect.signature(torch_fully_shard).bind(module, mesh=mesh, **fully_shard_kwargs)
        except TypeError as exc:
            raise TypeError(f"{NAME}: {exc} (the keywords torch's fully_shard takes pass through)") from None

    specs, cost_spec, weights = agreed_settings(module, values, pg, NAME, once_and_by_torch_signature)
    torch_fully_shard(module, mesh=mesh, **fully_shard_kwargs)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    comm = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    group = RankGroup(pg, rank, world, comm)
    module.__dict__["_dpfast_calls"] = _ShardedCalls(values, specs, cost_spec, weights, group)
    module.__class__ = _sharded_class(type(module))
    return module


class _ShardedCall:
    """The level ``fully_shard`` adds to an FSDP class: its ``__call__`` (see the module docstring)."""

    _dpfast_calls: _ShardedCalls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        calls, run = self._dpfast_calls, super().__call__  # type: ignore[misc]
        part = calls.before(self, args, kwargs)
        if part.empty is not None:
            outputs = calls.run_empty(run, self, part)
        else:
            try:
                outputs = run(*part.args, **part.kwargs)  # torch's call: compiled where its caller is
            except Exception as exc:
                calls.failed(part, exc)
                raise
        return calls.after(outputs, part)


def _sharded_class(fsdp_class: type) -> type:
    """The FSDP class with the level above, made for each sharded root (one a model: no table of classes)."""
    # FSDPModule.__new__ finds the module's own class (for slicing a container) by its place in the MRO
    index = getattr(fsdp_class, "_orig_cls_mro_index", 2) + 2
    attrs = {"_orig_cls_mro_index": index, "__module__": fsdp_class.__module__}
    return type(fsdp_class.__name__, (_ShardedCall, fsdp_class), attrs)


@dataclasses.dataclass
class _ShardedCalls:
    """One sharded module's settings, checks and output exchange."""

    values: dict[str, Any]
    specs: Binding
    cost: CostSource | None
    weights: Any
    group: RankGroup
    checks: StepChecks = dataclasses.field(init=False)
    exchange: ExchangeLayouts = dataclasses.field(default_factory=ExchangeLayouts)
    record: StepRecord | None = None  # the last forward's, which fails when its module raises
    check_after: bool = False  # the last forward's: a rank had no rows, so the ranks check again after it

    def __post_init__(self) -> None:
        check_group = self.group.on_host() if self.values["check_batch"] else self.group  # read before each forward
        self.checks = StepChecks(check_group, enabled=bool(self.values["check_batch"]), name=NAME)

    # the split, the check and the gather run as they are under torch.compile (graph breaks around the module's
    # forward, which is compiled): they are collectives and Python bookkeeping that tracing cannot hold
    @run_by_dynamo_as_it_is
    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> RankCall:
        """Plan the call, check it with the other ranks (every rank raises here when one cannot plan or the ranks
        disagree) and take this rank's part. FSDP's all-gather of the root's parameters, which its forward hook
        waits for, starts while the check's is in flight."""
        v, g = self.values, self.group
        per_rank = v["inputs"] == "per_rank"
        plan, error = plan_rank_call(self.specs, args, kwargs, 1 if per_rank else g.world, self.weights, self.cost)
        self.record = record_of(plan, error, v["check_batch"], per_rank)
        unshards: list[Any] = []
        try:
            mine = 1 if plan is None or plan.batch_size is None else plan.batch_size  # (read for per-rank inputs)
            every = self.checks.check_before(self.record, lambda: unshards.append(module.unshard(async_op=True)), mine)
            if plan is None:
                assert error is not None  # (the checks are off)
                raise error
            sizes = every if per_rank else plan.sizes if plan.mode == "split" else ()
            self.check_after = every is not None and not v["gather_outputs"] and 0 in (sizes or ())
            average = v["gather_outputs"] and not per_rank
            subs = through_input_grads(plan.tree, g, average) if torch.is_grad_enabled() else {}
            return rank_call(plan, args, kwargs, g.rank, g.world, per_rank, subs, lambda a, k: (a, k))
        except BaseException:
            for handle in unshards:  # FSDP's hook will not take this all-gather: a later forward would, stale
                handle.wait()
                module.reshard()
            raise

    @run_by_dynamo_as_it_is
    def failed(self, part: RankCall, exc: BaseException, status: int = MODULE_RAISED) -> None:
        """This rank could not run its part (its module raised, or it has no rows and refused them): with gathered
        outputs the others wait in the exchange, which carries the failure, and in a step where a rank has no rows
        they wait in the check after it (every rank raises there); otherwise the caller re-raises."""
        if self.values["check_batch"] and (self.values["gather_outputs"] or self.check_after):
            self.record.fail(status, exc)
            self.checks.records.append(self.record)
            if self.values["gather_outputs"]:
                self._gather(None, part, failed=True)
            else:
                self.checks.check_now()

    @run_by_dynamo_as_it_is
    def after(self, outputs: Any, part: RankCall) -> Any:
        if self.values["gather_outputs"]:
            return self._gather(outputs, part, failed=False)
        if self.check_after:  # a rank had no rows: did it run its part? (no later collective would say)
            self.checks.records.append(self.record)
            self.checks.check_now()
        return outputs

    @run_by_dynamo_as_it_is
    def run_empty(self, run: Callable[..., Any], module: nn.Module, part: RankCall) -> Any:
        """A rank without rows: its ghost, or with per-rank inputs its empty share (see the module docstring)."""
        empty = part.empty
        assert empty is not None
        if empty.ghost is not None:  # straight to the ghost (see the module docstring)
            empty = EmptyShare(None, empty.ghost)
        log = CollectiveLog(keep_results=True)
        with log:
            result = run_empty_share(run, module, empty, log, self.values["out_dims"], self.values["dim"])
        if result.status in (EMPTY_REFUSED, GHOST_COUNTED):
            error = DistributedBatchError(
                f"{NAME}: rank {self.group.rank} has no rows and cannot run its part ({result.error})"
            )
            error.__cause__ = result.error
            self.failed(part, error, result.status)
            raise error
        return result.outputs

    def _gather(self, outputs: Any, part: RankCall, failed: bool) -> Any:
        v, s = self.values, part.share
        per_rank = v["inputs"] == "per_rank"
        call = OutputsCall(
            self.group,
            v["out_dims"],
            v["dim"],
            self.checks.row(),
            self.checks.verify,
            None if per_rank else (s.sizes if s is not None else ()),
            part.pending_rows if per_rank else None,
            self.exchange,
            NAME,
        )
        return gather_across_ranks(call, outputs, failed)[0]
