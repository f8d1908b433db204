"""``dpfast.DistributedDataParallel``: ``torch.nn.parallel.DistributedDataParallel`` with dpfast's ``in_dims`` /
``out_dims``, fed the **global** batch on every rank.

Switching from :class:`dpfast.DataParallel` is one line::

    model = dpfast.DataParallel(net, in_dims={"h": 1}, out_dims=(0, 0, 1))
    model = dpfast.DistributedDataParallel(net, in_dims={"h": 1}, out_dims=(0, 0, 1), gather_outputs=True)

What one forward does, on every rank:

1. Plan the call with ``DataParallel``'s planning stage over ``world_size`` parts (same binding, same
   :class:`~dpfast.ScatterError` for a bad batch).
2. **Agree on the batch** (unless ``check_batch=False``): one small all-gather of ``(status, B, fingerprint)``. The
   fingerprint hashes the argument structure and the shape/dtype of every tensor to split (``check_batch="values"``
   also hashes their bytes). Any disagreement, or a rank whose own inputs are bad, raises
   :class:`DistributedBatchError` on **every** rank, with a line per rank, instead of hanging in a later collective.
3. Keep this rank's share of that plan: rank ``r`` gets the rows replica ``r`` would get (earlier ranks take the
   remainder; ``chunk_sizes`` weights ranks; ``cost`` balances per-sample costs instead of counts, and the split
   itself is part of what the ranks agree on). Inputs with spec ``None`` are used as given.
4. Run the module through ``torch``'s DDP forward (reducer, ``find_unused_parameters``, ``no_sync`` ... unchanged).
5. With ``gather_outputs=True``, combine the outputs across ranks with a differentiable collective so every rank
   holds the full-batch result (see "Gradient math" below).

Ranks with no share (``B < world_size``, or a ``chunk_sizes`` weight of 0) still run a forward, so DDP's
gradient all-reduce sees every parameter and nothing hangs: the module is called on an **empty slice** (``B = 0``
along each mapped axis; Linear, convolutions, LSTM/GRU, BatchNorm... accept it and give exactly-zero gradients).
If the module raises on an empty batch, it is called on a **ghost**: the first sample of the global batch, whose
outputs are then cut to zero rows (int specs) or replaced by zeros (``"sum"``/``"mean"``, 0-dim) through ops whose
backward is zero, so the gradients stay exactly zero but reach the same parameters. (A ghost is a real forward:
it runs dropout and updates BatchNorm running statistics with that sample.) When there is nothing to split
(``B == 0``, or no tensor with an int spec), every rank runs the whole input, and only rank 0's outputs count when
gathering (as ``DataParallel`` runs one replica).

Gradient math with ``gather_outputs=True``: rank ``r`` computes ``o_r = f(x_r; θ)``; the gather gives every rank
``O = [o_0, ..., o_{W-1}]`` and every rank computes the same loss ``L(O)`` and calls ``backward``. The backward of
the gather is the exact adjoint of an all-gather in the global graph: the output gradients of **all** ranks are
summed (all-reduce) and rank ``r`` keeps its slice, ``W · ∂L/∂o_r`` (for ``"mean"``/``"sum"`` outputs,
``c_r · W · ∂L/∂v`` with ``c_r`` the rank's weight). Rank ``r``'s parameter gradient is ``W · J_rᵀ ∂L/∂o_r``, and
DDP's all-reduce *averages*: ``(1/W) Σ_r W · J_rᵀ ∂L/∂o_r = ∂L/∂θ``, exactly the single-process full-batch
gradient. (Summing rather than scaling by ``W`` locally keeps this right even if ranks compute different losses:
the gradient is then that of their mean.) Every rank must use the gathered outputs the same way (each gathered
output either in every rank's loss or in none) and call ``backward``: the gather's backward is a collective.

Gradients w.r.t. the call's tensor inputs (those with ``requires_grad``, e.g. a learned initial state) are
averaged over ranks like the parameters' (one all-reduce in backward, through
:class:`~dpfast.distributed.exchanges.AverageInputGrads`), so with ``gather_outputs`` every rank's ``x.grad`` is
the full-batch one too.

Without ``gather_outputs`` you get this rank's outputs and DDP's usual semantics: gradients are averaged over ranks.
For a per-sample-mean loss on uneven shares, multiply the local loss by :attr:`DistributedDataParallel.loss_scale`
(``W · n_r / B``) to get exactly the full-batch gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.utils import _to_kwargs

from ..plan.call_plan import CallPlan, plan_call
from ..plan.costs import CostSource
from ..plan.errors import ScatterError
from ..plan.splits import validate_chunk_sizes
from ..trees.binding import Binding, BoundArguments, forward_of
from ..trees.flatten import unflatten
from ..trees.specs import Leaf, Spec, match_spec, validate_spec
from .agreement import agree_on_batch
from .exchanges import AverageInputGrads, RankGroup, ZeroOut
from .outputs import gather_across_ranks
from .sharding import Share, take_rows


@dataclasses.dataclass
class _EmptyShare:
    """How a rank with no rows runs: an empty slice first (``try_empty``), else a ghost of one real sample."""

    plan: CallPlan
    subs: dict  # the inputs seen through AverageInputGrads
    try_empty: bool


def zero_ghost_outputs(out: Any, out_dims: Spec, dim: int) -> Any:
    """A ghost's outputs counted as nothing: int-spec tensors cut to zero rows, the rest zeroed with a zero
    gradient (the graph still reaches the same parameters, so DDP's reducer sees them all)."""
    spec = dim if out_dims is None else out_dims
    leaves: list[Leaf] = []
    tdef = match_spec(out, spec, "output", dim, out_dims is not None, "out_dims", leaves)
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


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` that takes the global batch and dpfast's ``in_dims``/``out_dims``.

    Args:
        module, device_ids, output_device: as for torch's DDP (one device per process: ``device_ids=[local_rank]``
            on GPUs, ``None`` on the CPU).
        in_dims, out_dims, dim, chunk_sizes, cost: as for :class:`dpfast.DataParallel`, with ranks in place of
            devices (``chunk_sizes`` has one relative weight per rank; ``cost`` balances the ranks' work, and
            every rank computes the same split from its copy of the global batch).
        gather_outputs: all-gather the outputs (differentiably) so every rank holds the full-batch result: int spec
            -> concatenated along that axis in rank order (a 0-dim output is stacked into ``(n_ranks_with_rows,)``),
            ``"sum"``/``"mean"`` -> reduced across ranks (``"mean"`` weighted by share), ``None`` -> this rank's own
            value. A loss on the gathered outputs gives exactly the full-batch gradients after DDP's averaging.
        check_batch: ``True`` (default) checks before every forward that all ranks got the same global batch
            (``B``, argument structure, shapes and dtypes of the tensors to split) with one small all-gather;
            ``"values"`` also compares a hash of their bytes (a device-to-host copy); ``False`` skips it (needed
            with ``DistributedDataParallel.join()``, where joined ranks stop calling forward).
        **ddp_kwargs: passed to torch's DDP (``process_group``, ``find_unused_parameters``, ``static_graph``,
            ``broadcast_buffers``, ``bucket_cap_mb``, ...).

    After each forward, :attr:`share` holds this rank's rows and :attr:`loss_scale` the factor ``W · n_r / B``
    that makes a local per-sample-mean loss give the full-batch gradient without ``gather_outputs``.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[Any] | None = None,
        output_device: Any = None,
        *,
        in_dims: Any = None,
        out_dims: Spec = None,
        dim: int = 0,
        chunk_sizes: Sequence[float] | None = None,
        cost: Any = None,
        gather_outputs: bool = False,
        check_batch: Any = True,
        **ddp_kwargs: Any,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if check_batch not in (True, False, "values"):
            raise ValueError(f"check_batch must be True, False or 'values', got {check_batch!r}")
        # Everything about the specs is checked before torch's DDP broadcasts anything.
        specs = Binding(forward_of(module), in_dims, dim)
        validate_spec(out_dims, "out_dims", allow_reductions=True)
        cost_spec = None if cost is None else CostSource(cost, specs)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "dpfast.DistributedDataParallel needs torch.distributed: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment for it)"
            )
        super().__init__(module, device_ids=device_ids, output_device=output_device, dim=dim, **ddp_kwargs)
        self.in_dims = in_dims
        self.out_dims = out_dims
        self.chunk_sizes = chunk_sizes
        self.cost = cost
        self._cost = cost_spec
        self.gather_outputs = bool(gather_outputs)
        self.check_batch = check_batch
        self._specs = specs
        self._rank = dist.get_rank(self.process_group)
        self._world = dist.get_world_size(self.process_group)
        self._weights = validate_chunk_sizes(chunk_sizes, self._world)
        backend = str(dist.get_backend(self.process_group)).lower()
        comm = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self._group = RankGroup(self.process_group, self._rank, self._world, comm)
        self.share: Share | None = None
        self._empty_share: _EmptyShare | None = None  # set for the forward of a rank that has no rows
        self._warned_empty = False
        self._buffer_source = 0  # the first rank that had rows in the last forward (see _sync_buffers)

    # -- properties -----------------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """``W · n_r / B`` for the last forward (1.0 when nothing was split): multiply a local per-sample-mean
        loss by it and DDP's averaged gradient is the full-batch one."""
        s = self.share
        if s is None or not s.sizes:
            return 1.0
        return s.world_size * s.size / s.batch_size

    # -- the call -------------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        plan: CallPlan | None = None
        error: BaseException | None = None
        try:
            plan = plan_call(self._specs, inputs, kwargs, self._world, self._weights, cost=self._cost)
        except (ScatterError, TypeError, ValueError) as exc:
            # planning can fail on one rank only (a structure that does not match its spec): that rank must reach
            # the agreement too, or the others wait there for it
            error = exc
        if self.check_batch:
            agree_on_batch(self._group, plan, error, self._specs.signature_text, self.check_batch == "values")
        if error is not None:
            raise error
        assert plan is not None
        args, kw = self._take_share(plan, inputs, kwargs)
        outputs = super().forward(*args, **kw)
        if self.check_batch:  # the ranks agreed on the batch, so on this plan (else they might not: rank 0, as torch)
            self._buffer_source = next((r for r, n in enumerate(plan.sizes) if n > 0), 0) if plan.mode == "split" else 0
        if not self.gather_outputs:
            return outputs
        return gather_across_ranks(self._group, outputs, self.out_dims, self.dim, self.share)

    def _take_share(self, plan: CallPlan, inputs: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """This rank's rows of the call (and :attr:`share`); a rank with none gets an empty slice (see the module
        docstring) and remembers how to run a ghost instead, for :meth:`_run_ddp_forward`."""
        W, r = self._world, self._rank
        subs = self._average_input_grads(plan.tree)
        self._empty_share = None
        if plan.mode != "split":  # nothing to split, or B == 0: every rank runs the whole input; rank 0's counts
            self.share = Share(r, W, plan.batch_size, (), 0, plan.batch_size or 0)
            return take_rows(plan.tree, [], 0, 0, subs) if subs else (inputs, kwargs)
        start, stop = plan.share(r)
        self.share = Share(r, W, plan.batch_size, tuple(plan.sizes), start, stop)
        if stop > start:
            return take_rows(plan.tree, plan.mapped, start, stop - start, subs)
        try:
            empty = take_rows(plan.tree, plan.mapped, start, 0, subs)
        except ValueError:  # a PackedSequence cannot hold zero sequences: straight to the ghost
            self._empty_share = _EmptyShare(plan, subs, try_empty=False)
            return inputs, kwargs
        self._empty_share = _EmptyShare(plan, subs, try_empty=True)
        return empty

    def _average_input_grads(self, tree: BoundArguments) -> dict:
        """The call's tensor inputs that require grad, seen through one :class:`AverageInputGrads` node."""
        if not torch.is_grad_enabled():
            return {}
        leaves = [leaf for leaf in tree.leaves if isinstance(leaf.value, Tensor) and leaf.value.requires_grad]
        if not leaves:
            return {}
        g = self._group
        views = AverageInputGrads.apply(g.process_group, g.world, g.comm_device, *[leaf.value for leaf in leaves])
        return {id(leaf): v for leaf, v in zip(leaves, views)}

    def _sync_buffers(self) -> None:
        """DDP broadcasts the buffers from rank 0 at each forward. A rank that had no rows in the last forward (a
        ``chunk_sizes`` weight of 0) holds buffers its module never updated (BatchNorm statistics that would never
        move), so the first rank that had rows is the source, as ``DataParallel`` keeps the buffers of the first
        replica that had rows. The ranks agreed on the batch (``check_batch``), so on the plan, and so on the source
        without asking; with ``check_batch=False`` they might not, and rank 0 stays the source."""
        if self._buffer_source == 0 or self._join_config.enable:
            return super()._sync_buffers()
        with torch.no_grad(), contextlib.ExitStack() as stack:
            self._assign_modules_buffers()
            preserve = getattr(torch.autograd, "_unsafe_preserve_version_counter", None)
            for b in self.modules_buffers if preserve else ():  # one tensor each: torch 2.4 takes no tuple
                stack.enter_context(preserve(b))
            self._sync_module_buffers(self._buffer_source)

    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Inside torch's DDP forward (between its pre- and post-forward): an empty share runs an empty slice, or
        a ghost when the module refuses an empty batch."""
        empty = self._empty_share
        if empty is None:
            return super()._run_ddp_forward(*inputs, **kwargs)
        if empty.try_empty:  # `inputs` is the empty slice, already moved to the device by DDP's pre-forward
            try:
                return super()._run_ddp_forward(*inputs, **kwargs)
            except Exception as exc:  # noqa: BLE001 - any refusal of B = 0; a real bug fails the ghost below too
                self._warn_ghost(exc)
        args, kw = take_rows(empty.plan.tree, empty.plan.mapped, 0, 1, empty.subs)
        if self.device_ids:  # as DDP's pre-forward moves inputs
            moved_args, moved_kw = _to_kwargs(
                args, kw, torch.device(self.device_type, self.device_ids[0]), self.use_side_stream_for_tensor_copies
            )
            args, kw = moved_args[0], moved_kw[0]
        return zero_ghost_outputs(super()._run_ddp_forward(*args, **kw), self.out_dims, self.dim)

    def _warn_ghost(self, exc: BaseException) -> None:
        if not self._warned_empty:
            self._warned_empty = True
            warnings.warn(
                f"dpfast.DistributedDataParallel: rank {self._rank} has no rows of this batch and the module "
                f"refused an empty one ({type(exc).__name__}: {exc}); it runs one real sample instead, whose "
                "outputs count as nothing (said once per module)",
                RuntimeWarning,
                stacklevel=3,
            )

    def extra_repr(self) -> str:
        parts = [f"world_size={self._world}"]
        for name in ("in_dims", "out_dims", "chunk_sizes", "cost"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)!r}")
        if self.gather_outputs:
            parts.append("gather_outputs=True")
        return ", ".join(parts)
