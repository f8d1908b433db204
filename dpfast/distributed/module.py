"""``dpfast.DistributedDataParallel``: ``torch.nn.parallel.DistributedDataParallel`` with dpfast's ``in_dims`` /
``out_dims``, fed the **global** batch on every rank (the one-line switch from ``dpfast.DataParallel``) or each
rank's **own rows** (``inputs="per_rank"``, as DDP users load data).

What one forward does, on every rank:

1. Plan the call by its call program (:mod:`dpfast.plan.program`), as ``DataParallel`` does: over ``world_size``
   parts for the global batch (rank ``r`` keeps the rows replica ``r`` would get; ``chunk_sizes`` weights ranks,
   ``cost`` balances per-sample costs), or as one part for per-rank inputs; and take this rank's rows
   (:mod:`dpfast.distributed.inputs`).
2. Record what the ranks must agree on (:mod:`dpfast.distributed.agreement`); the check itself travels with a
   collective the step runs anyway (:mod:`dpfast.distributed.bucket_check`), so an ordinary step adds none.
3. Run this rank's rows through ``torch``'s DDP forward (reducer, ``find_unused_parameters``, ``no_sync`` ...
   unchanged). A rank with no rows runs an empty share (:mod:`dpfast.distributed.empty_ranks`).
4. With ``gather_outputs=True``, combine the outputs across ranks with a differentiable exchange so every rank
   holds the full-batch result (:mod:`dpfast.distributed.outputs`); a loss on them gives, after DDP's averaging,
   exactly the full-batch gradients (:mod:`dpfast.distributed.output_adjoint` says why).
Without it, this rank's outputs and DDP's usual semantics (see :attr:`DistributedDataParallel.loss_scale`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import profiler
from torch.distributed.utils import _to_kwargs

from ..plan.call_plan import CallPlan
from ..trees.specs import Spec
from .agreement import StepChecks, StepRecord, record_of
from .bucket_check import BucketCheck, NativeBucketCheck, native_hook_available
from .disagreement import EMPTY_REFUSED, GHOST_COUNTED, MODULE_RAISED
from .empty_ranks import CollectiveLog, EmptyRankSteps, EmptyShare, _ShareRefused, replay
from .group import RankGroup
from .inputs import Share, per_rank_share, plan_rank_call, rank_call, through_input_grads
from .output_layout import ExchangeLayouts
from .outputs import OutputsCall, gather_across_ranks
from .settings import FIXED, agreed_settings, check_settings, torch_ddp_kwargs
from .torch_ddp_methods import TorchDDPMethods

# the names torch's DistributedDataParallel.forward uses: the steps _ddp_forward copies, and the label
# fmt: off
_TORCH_FORWARD_NAMES = ("torch", "autograd", "profiler", "record_function", "_pre_forward",
                        "_delay_all_reduce_all_params", "module", "forward", "_run_ddp_forward", "_post_forward")
# fmt: on
# compiled code takes torch's forward, which dynamo knows (the profiler checks below are calls it cannot trace)
_compiling = torch.compiler.is_compiling
_profiler_on = getattr(torch._C._autograd, "_profiler_enabled", None)  # a profiler recording this thread
_TORCH_FORWARD_COPIED = (
    nn.parallel.DistributedDataParallel.forward.__code__.co_names == _TORCH_FORWARD_NAMES
    and _profiler_on is not None
    and hasattr(profiler, "_is_profiler_enabled")  # set by any torch.autograd.profiler.profile: a second check
)


@dataclasses.dataclass
class _CallState:
    """What this rank's last forward left for the properties and DDP's overrides (one plain object: cheap to set)."""

    share: Share | None = None
    pending_rows: int | None = None  # per-rank inputs: this rank's rows, until every rank's are known
    empty: EmptyShare | None = None  # set for the forward of a rank that has no rows
    log: CollectiveLog | None = None  # the process-group collectives of the forward
    ghost_error: BaseException | None = None
    exchange: ExchangeLayouts = dataclasses.field(default_factory=ExchangeLayouts)  # gather_outputs' capacity, layouts


class DistributedDataParallel(TorchDDPMethods, EmptyRankSteps, nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` with dpfast's ``in_dims``/``out_dims``.

    Args:
        module: the module to train, as for torch's DDP.
        device_ids: as for torch's DDP: one device per process, ``[local_rank]`` on GPUs, ``None`` on the CPU.
        output_device: as for torch's DDP.
        dim: as for :class:`dpfast.DataParallel` (and in torch's place, so torch's positional arguments fit).
        *torch_args: torch DDP's arguments after ``dim`` by position (``broadcast_buffers``, ``init_sync``,
            ``process_group``, ...), as its constructor takes them.
        inputs: ``"global"`` (default): every rank is given the same global batch and keeps its rows, by the plan
            ``DataParallel`` makes over ``world_size`` devices. ``"per_rank"``: every rank passes only its own rows
            (a share from :func:`~dpfast.distributed.shard_batch`, a
            :class:`~dpfast.distributed.BalancedBatchSampler`, any per-rank loader); shares may differ in size.
        in_dims: as for :class:`dpfast.DataParallel`.
        out_dims: as for :class:`dpfast.DataParallel`.
        chunk_sizes: as for :class:`dpfast.DataParallel`, with ranks in place of devices (``inputs="global"`` only):
            one relative weight per rank.
        cost: as for :class:`dpfast.DataParallel`, with ranks in place of devices (``inputs="global"`` only): it
            balances the ranks' work, and every rank computes the same split from its copy of the global batch.
        gather_outputs: all-gather the outputs (differentiably) so every rank holds the full-batch result: int spec
            -> concatenated along that axis in rank order (a 0-dim output is stacked into ``(n_ranks_with_rows,)``),
            ``"sum"``/``"mean"`` -> reduced across ranks (``"mean"`` weighted by share), ``None`` -> this rank's own
            value. A loss on the gathered outputs gives exactly the full-batch gradients after DDP's averaging.
        check_batch: ``True`` (default): the ranks check that they agree on every step (``B``, the split, the
            argument structure, shapes and dtypes; per-rank inputs: structure and dtypes), inside a collective the
            step runs anyway: the output all-gather with ``gather_outputs``, else DDP's first gradient bucket (a
            mismatch then raises from ``backward()``); under ``torch.no_grad()`` without ``gather_outputs``, and on
            the first call, one small all-gather. ``"values"`` also compares a hash of the split tensors' bytes (a
            device-to-host copy); ``False`` skips it. Under ``join()`` a joined rank's part is not compared, and
            the first call is checked with its backward.
        **ddp_kwargs: passed to torch's DDP (``process_group``, ``find_unused_parameters``, ``static_graph``,
            ``broadcast_buffers``, ``bucket_cap_mb``, ...).

    Raises:
        DistributedBatchError: on every rank, when the ranks were built with different settings (here), or when a
            step finds that they disagree or that one cannot run its part (see ``check_batch``).
        TypeError, ValueError: invalid settings (on every rank alike).
        RuntimeError: ``torch.distributed`` is not initialized.

    The settings above are fixed once built (every rank agreed on them): assigning one raises ``AttributeError``.
    After each forward, :attr:`share` holds this rank's rows and :attr:`loss_scale` the factor ``W · n_r / B``
    that makes a local per-sample-mean loss give the full-batch gradient without ``gather_outputs``.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[Any] | None = None,
        output_device: Any = None,
        dim: int = 0,
        *torch_args: Any,
        inputs: str = "global",
        in_dims: Any = None,
        out_dims: Spec = None,
        chunk_sizes: Sequence[float] | None = None,
        cost: Any = None,
        gather_outputs: bool = False,
        check_batch: Any = True,
        **ddp_kwargs: Any,
    ) -> None:
        ddp_kwargs = torch_ddp_kwargs(torch_args, ddp_kwargs)
        values = dict(inputs=inputs, in_dims=in_dims, out_dims=out_dims, dim=dim, chunk_sizes=chunk_sizes)
        values.update(cost=cost, gather_outputs=bool(gather_outputs), check_batch=check_batch)
        ready = dist.is_available() and dist.is_initialized()
        pg = ddp_kwargs.get("process_group")
        if not ready:
            check_settings(module, values, None)  # a mistake in the settings is named first
            raise RuntimeError(
                "dpfast.DistributedDataParallel needs torch.distributed: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment for it)"
            )
        # everything about the settings is checked before torch's DDP broadcasts anything
        specs, cost_spec, weights = agreed_settings(module, values, pg)
        super().__init__(module, device_ids=device_ids, output_device=output_device, dim=dim, **ddp_kwargs)
        for name in FIXED:
            setattr(self, name, values[name])
        self._specs, self._cost, self._weights = specs, cost_spec, weights
        self._install_checks()
        self._settings_fixed = True

    def _install_checks(self) -> None:
        """This process's ranks and the step's check on DDP's reducer (again after unpickling, on a new one)."""
        self._rank, self._world = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        backend = str(dist.get_backend(self.process_group)).lower()
        comm = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self._group = RankGroup(self.process_group, self._rank, self._world, comm)
        self._checks = StepChecks(self._group, enabled=bool(self.check_batch))
        self._bucket_check: BucketCheck | NativeBucketCheck | None = None
        if self.check_batch and not self.gather_outputs:
            c = self._checks
            python_reducer = getattr(self, "_use_python_reducer", False)  # compiled autograd: Python hooks only
            if not python_reducer and native_hook_available(self.module, self._group):
                self._bucket_check = NativeBucketCheck(self.reducer, self._group, c.row, c.verify, c.agreed)
            else:
                self._bucket_check = BucketCheck(self._group, c.row, c.verify, c.agreed)
                if python_reducer:  # it reads the hooks torch's register_comm_hook lists
                    nn.parallel.DistributedDataParallel.register_comm_hook(self, None, self._bucket_check.hook)
                else:  # not as the user's hook: torch's bookkeeping (the logged hook name) stays the user's
                    dist._register_comm_hook(self.reducer, None, self._bucket_check.hook)
        self._call = _CallState()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FIXED and self.__dict__.get("_settings_fixed"):
            raise AttributeError(
                f"DistributedDataParallel.{name} is fixed once built: every rank agreed on it in the constructor, "
                "and a change on one rank would make the ranks wait in different collectives; build a new "
                f"DistributedDataParallel with {name}={value!r} on every rank instead"
            )
        super().__setattr__(name, value)

    # -- properties -----------------------------------------------------------------------------------------

    @property
    def share(self) -> Share | None:
        """This rank's part of the last forward's batch (``None`` before the first). With ``inputs="per_rank"``
        and without ``gather_outputs`` the other ranks' row counts come from one small all-gather, run at the
        first read after a forward: read it (or :attr:`loss_scale`) on every rank or on none."""
        if self._call.pending_rows is not None:
            rows, self._call.pending_rows = self._call.pending_rows, None
            self._call.share = per_rank_share(self._rank, self._exchange_sizes(rows))
        return self._call.share

    @property
    def loss_scale(self) -> float:
        """``W · n_r / B`` for the last forward (1.0 when nothing was split): multiply a local per-sample-mean
        loss by it and DDP's averaged gradient is the full-batch one."""
        s = self.share
        if s is None or not s.sizes or not s.batch_size:
            return 1.0
        return s.world_size * s.size / s.batch_size

    def _exchange_sizes(self, rows: int) -> list[int]:
        """Per-rank inputs without gather_outputs: every rank's row count, from one small all-gather."""
        g = self._group
        mine = torch.tensor([rows], dtype=torch.int64, device=g.comm_device)
        everyone = [torch.empty_like(mine) for _ in range(g.world)]
        dist.all_gather(everyone, mine, group=g.process_group)
        self._checks.exchanged_sizes()
        return torch.cat(everyone).tolist()

    # -- the call -------------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run this rank's rows of the call through torch's DDP forward (call the wrapper, not ``forward``).

        Args:
            *inputs: ``module.forward``'s positional arguments: the global batch (``inputs="global"``), or this
                rank's own rows (``inputs="per_rank"``).
            **kwargs: its keyword arguments, treated as ``in_dims`` names them.

        Returns:
            This rank's outputs; with ``gather_outputs``, the outputs combined across ranks as ``out_dims`` says
            (the full batch's, on every rank).

        Raises:
            DistributedBatchError: on every rank, when the ranks disagree on the batch or one cannot run its part
                (without ``gather_outputs`` it may come from the following ``backward()``; see ``check_batch``).
            dpfast.ScatterError, TypeError, ValueError: this rank cannot plan its call (with ``check_batch=False``;
                otherwise every rank raises ``DistributedBatchError`` for it).
        """
        if self._bucket_check is not None:
            self._bucket_check.read_deferred()  # CUDA: the last backward's check
        joining = self._sync_join_mode()
        parts = 1 if self.inputs == "per_rank" else self._world
        plan, error = plan_rank_call(self._specs, inputs, kwargs, parts, self._weights, self._cost)
        record = record_of(plan, error, self.check_batch, self.inputs == "per_rank")
        self._checks.begin(record, joining)  # the first call is checked here, before anything runs (on every rank)
        if error is not None:
            if not self.check_batch:
                raise error
            return self._keep_step(record, ran_forward=False)
        args, kw = self._take_share(plan, inputs, kwargs)
        first = plan.sizes.index(next(filter(None, plan.sizes))) if plan.mode == "split" else 0  # buffers' source
        return self._run_share(record, args, kw, first)

    def _run_share(self, record: StepRecord, args: tuple, kw: dict, first: int) -> Any:
        """Run this rank's share through torch's DDP forward, then the step's check (where every rank raises
        when one's module raised: each its own error when every rank's did)."""
        log = self._call.log = CollectiveLog(keep_results=self._call.empty is not None)
        self._call.ghost_error = None
        try:
            with log:
                outputs = self._ddp_forward(args, kw)
        except _ShareRefused as refused:
            record.fail(EMPTY_REFUSED, refused.error)
            return self._keep_step(record, ran_forward=True)
        except Exception as exc:  # the others wait in the step's collectives: issue the rest, then the check
            if not self.check_batch:
                raise
            record.fail(MODULE_RAISED, exc)
            replay((self._checks.trace or [])[len(log.entries) :])
            return self._keep_step(record, ran_forward=True)
        if self._call.ghost_error is not None:
            record.fail(GHOST_COUNTED, self._call.ghost_error)
        if self.check_batch:
            self._checks.ran(self._call.log.entries, first)
        return self._finish(outputs)

    def _finish(self, outputs: Any) -> Any:
        """The step's check where a collective carries it, then the outputs (gathered, with gather_outputs)."""
        if self.gather_outputs:
            return self._gather(outputs, failed=False)
        if self._join_config.enable:
            return outputs  # a joined rank shadows no check in forward: the first bucket carries it
        if not torch.is_grad_enabled() or (self._call.log is not None and self._call.log.entries):
            # no collective follows a no_grad forward; and after collectives in forward, the backward runs their
            # adjoints, which a rank that cannot run its module could not issue: check now, before any backward
            self._checks.check_now()
        return outputs  # else the check rides in the first gradient bucket (or waits for a synchronized backward)

    def _gather(self, outputs: Any, failed: bool) -> Any:
        s = self._call.share
        per_rank = self.inputs == "per_rank"
        call = OutputsCall(
            self._group,
            self.out_dims,
            self.dim,
            self._checks.row(),
            self._checks.verify,
            None if per_rank else (s.sizes if s is not None else ()),
            self._call.pending_rows if per_rank else None,
            self._call.exchange,
        )
        result, rows = gather_across_ranks(call, outputs, failed)
        if per_rank and rows is not None and min(rows) >= 0:
            self._call.pending_rows, self._call.share = None, per_rank_share(self._rank, rows)
        return result

    def _take_share(self, plan: CallPlan, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """This rank's rows of the call (and :attr:`share`); a rank with none gets an empty share."""
        average = self.gather_outputs and self.inputs == "global"
        subs = through_input_grads(plan.tree, self._group, average) if torch.is_grad_enabled() else {}
        part = rank_call(plan, inputs, kwargs, self._rank, self._world, self.inputs == "per_rank", subs, self._moved)
        self._call.share, self._call.pending_rows, self._call.empty = part.share, part.pending_rows, part.empty
        return part.args, part.kwargs

    def _moved(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``(args, kwargs)`` moved to this rank's device, as DDP's pre-forward moves the inputs."""
        if not self.device_ids:
            return args, kwargs
        device = torch.device(self.device_type, self.device_ids[0])
        moved_args, moved_kwargs = _to_kwargs(args, kwargs, device, self.use_side_stream_for_tensor_copies)
        return moved_args[0], moved_kwargs[0]

    def _ddp_forward(self, args: tuple, kwargs: dict) -> Any:
        """torch's DDP ``forward`` on this rank's share, entering its profiler label only while a profiler records
        (torch's own ``forward`` runs then, under ``torch.compile``, and where its code is not the one copied)."""
        if not _TORCH_FORWARD_COPIED or _compiling() or profiler._is_profiler_enabled or _profiler_on():
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        args, kwargs = self._pre_forward(*args, **kwargs)
        if self._delay_all_reduce_all_params:
            return self._post_forward(self.module.forward(*args, **kwargs))
        return self._post_forward(self._run_ddp_forward(*args, **kwargs))

    def extra_repr(self) -> str:
        """The settings ``repr()`` shows: the world size and what differs from the defaults.

        Returns:
            ``"world_size=2, in_dims={'h': 1}, gather_outputs=True"`` and the like.

        Raises:
            Nothing: it reads the settings only.
        """
        parts = [f"world_size={self._world}"] + (["inputs='per_rank'"] if self.inputs == "per_rank" else [])
        for name in ("in_dims", "out_dims", "chunk_sizes", "cost"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)!r}")
        if self.gather_outputs:
            parts.append("gather_outputs=True")
        return ", ".join(parts)
