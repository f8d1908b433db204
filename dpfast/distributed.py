"""``dpfast.DistributedDataParallel``: ``torch.nn.parallel.DistributedDataParallel`` with dpfast's ``in_dims`` /
``out_dims``, fed the **global** batch on every rank.

Switching from :class:`dpfast.DataParallel` is one line::

    model = dpfast.DataParallel(net, in_dims={"h": 1}, out_dims=(0, 0, 1))
    model = dpfast.DistributedDataParallel(net, in_dims={"h": 1}, out_dims=(0, 0, 1), gather_outputs=True)

What one forward does, on every rank:

1. Bind the call to ``forward``'s signature and find ``B`` exactly as ``DataParallel`` does (same
   :class:`~dpfast.ScatterError` for a bad batch).
2. **Agree on the batch** (unless ``check_batch=False``): one small all-gather of ``(status, B, fingerprint)``. The
   fingerprint hashes the argument structure and the shape/dtype of every tensor to split (``check_batch="values"``
   also hashes their bytes). Any disagreement, or a rank whose own inputs are bad, raises
   :class:`DistributedBatchError` on **every** rank, with a line per rank, instead of hanging in a later collective.
3. Keep this rank's share: ``split_sizes(B, world_size, chunk_sizes)`` is the very function ``DataParallel`` uses to
   split over ``world_size`` devices, so rank ``r`` gets the rows replica ``r`` would get (earlier ranks take the
   remainder; ``chunk_sizes`` weights ranks). Inputs with spec ``None`` are used as given.
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
averaged over ranks like the parameters' (one all-reduce in backward, through :class:`_AverageInputGrads`), so with
``gather_outputs`` every rank's ``x.grad`` is the full-batch one too.

Without ``gather_outputs`` you get this rank's outputs and DDP's usual semantics: gradients are averaged over ranks.
For a per-sample-mean loss on uneven shares, multiply the local loss by :attr:`DistributedDataParallel.loss_scale`
(``W · n_r / B``) to get exactly the full-batch gradient.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.utils import _to_kwargs
from torch.nn.utils.rnn import PackedSequence

from ._binding import ArgumentSpecs, ArgumentTree, forward_of
from ._errors import ScatterError
from ._planning import Mapped, check_batch, mapped_leaves
from ._render import shape_text
from ._specs import Spec, SpecLeaf, match_spec, validate_spec
from ._splits import split_sizes, validate_chunk_sizes
from ._transfer import scatter_packed
from ._tree import unflatten

__all__ = [
    "DistributedDataParallel",
    "DistributedBatchError",
    "Share",
    "shard_batch",
    "shard_range",
    "shard_dataset",
]


class DistributedBatchError(ScatterError):
    """The ranks were not given the same global batch (or one rank's inputs are bad); raised on every rank."""


class Share(NamedTuple):
    """This rank's part of one global batch: rows ``start:stop`` of ``batch_size`` (``None``: nothing to split)."""

    rank: int
    world_size: int
    batch_size: int | None
    sizes: tuple  # rows per rank; () when nothing is split
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


# ---------------------------------------------------------------------------------------------------------------
# Taking one rank's rows of an argument tree
# ---------------------------------------------------------------------------------------------------------------


def _take(
    tree: ArgumentTree,
    mapped: Sequence[Mapped],
    start: int,
    length: int,
    sizes: Sequence[int],
    index: int,
    subs: dict | None = None,
) -> tuple[tuple, dict]:
    """The call's ``(args, kwargs)`` with every mapped leaf cut to rows ``start:start+length`` along its axis.

    Tensors are narrowed (a view when the axis is 0, else made contiguous); PackedSequences are split by sequence in
    the caller's order with the same code ``DataParallel`` uses (``sizes`` and ``index`` are not needed for that and
    are kept for the callers). Everything else,
    spec ``None`` included, is passed as given.
    """
    by_leaf = {id(m.leaf): m for m in mapped}
    subs = subs or {}
    values = []
    for leaf in tree.leaves:
        m = by_leaf.get(id(leaf))
        value = subs.get(id(leaf), leaf.value)  # (DDP: the input as seen through _AverageInputGrads)
        if m is None:
            values.append(value)
        elif m.is_packed:
            if length == 0:
                raise ValueError(f"`{leaf.path}` is a PackedSequence, which cannot hold zero sequences")
            # sequences start:start+length; the other ranks' rows as (at most) two chunks, never an empty one
            # (scatter_packed cannot pack zero sequences), so empty shares elsewhere and the ghost work too
            ps = leaf.value
            parts = [n for n in (start, length, m.size - start - length) if n]
            values.append(scatter_packed(ps, parts, [ps.data.device] * len(parts))[1 if start else 0])
        else:
            v = value.narrow(m.axis, start, length)
            values.append(v if m.axis == 0 else v.contiguous())
    return tree.rebuild(values)


def _rank_world(rank: int | None, world_size: int | None, group=None) -> tuple[int, int]:
    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "rank and world_size are needed when torch.distributed is not initialized "
                "(call torch.distributed.init_process_group first, or pass them)"
            )
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return rank, world_size


def shard_range(
    n: int,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    chunk_sizes: Sequence[float] | None = None,
) -> range:
    """The indices ``range(start, stop)`` of ``n`` items that ``rank`` owns: the same contiguous, as-even-as-possible
    split (earlier ranks take the remainder, ``chunk_sizes`` weights ranks) that :class:`DistributedDataParallel`
    and ``DataParallel`` use. Nothing is dropped or repeated: the ranges of all ranks partition ``range(n)``."""
    rank, world_size = _rank_world(rank, world_size)
    sizes = split_sizes(n, world_size, validate_chunk_sizes(chunk_sizes, world_size))
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])


def shard_dataset(
    dataset,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    chunk_sizes: Sequence[float] | None = None,
) -> torch.utils.data.Subset:
    """``rank``'s contiguous share of a map-style dataset, as a :class:`torch.utils.data.Subset` (see
    :func:`shard_range`). For per-rank loading: every rank must still run the same number of steps (DDP's gradient
    all-reduce is a collective), so with uneven shares use equal step counts or ``torch.utils.data.DistributedSampler``
    (which pads by repeating samples) instead."""
    return torch.utils.data.Subset(dataset, list(shard_range(len(dataset), rank, world_size, chunk_sizes=chunk_sizes)))


def _one_batch(batch):  # the signature shard_batch binds its in_dims to
    return batch


def shard_batch(
    batch: Any,
    rank: int | None = None,
    world_size: int | None = None,
    *,
    in_dims: Spec = None,
    dim: int = 0,
    chunk_sizes: Sequence[float] | None = None,
) -> Any:
    """``rank``'s share of one global ``batch`` (a tensor or any tuple/list/dict/namedtuple/dataclass tree of them),
    cut exactly as :class:`DistributedDataParallel` cuts its inputs.

    ``in_dims`` is a spec prefix of ``batch`` (default ``dim`` everywhere; ``None`` leaves keep tensors whole); the
    batch-size checks and :class:`~dpfast.ScatterError` are ``DataParallel``'s. A rank with no rows gets empty
    slices. When nothing is split (no tensor with an int spec), every rank gets ``batch`` unchanged.
    ``rank``/``world_size`` default to the initialized process group's.
    """
    rank, world_size = _rank_world(rank, world_size)
    weights = validate_chunk_sizes(chunk_sizes, world_size)
    if in_dims is not None:
        validate_spec(in_dims, "in_dims", allow_reductions=False)
    specs = ArgumentSpecs(_one_batch, None if in_dims is None else {"batch": in_dims}, dim)
    tree = ArgumentTree(specs, (batch,), {})
    mapped = mapped_leaves(tree)
    b = check_batch(tree, specs, mapped)
    if b is None:
        return batch
    sizes = split_sizes(b, world_size, weights)
    start = sum(sizes[:rank])
    args, _ = _take(tree, mapped, start, sizes[rank], sizes, rank)
    return args[0]


# ---------------------------------------------------------------------------------------------------------------
# Differentiable collectives for gather_outputs
# ---------------------------------------------------------------------------------------------------------------


class _ZeroOut(torch.autograd.Function):
    """Zeros shaped like the input, with a zero gradient: keeps a ghost's graph connected while contributing 0."""

    @staticmethod
    def forward(ctx, x):
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g)


class _Exchange(torch.autograd.Function):
    """Forward: all-gather the "cat" tensors (variable rows per rank) and all-reduce the weighted "red" tensors.
    Backward: all-reduce the output gradients of every rank (the adjoint of both) and keep this rank's part.

    One node for all outputs, so its backward issues its collectives at one point of every rank's backward pass.
    """

    @staticmethod
    def forward(ctx, plan, *tensors):
        ctx.plan = plan
        outs = plan.forward(tensors)
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(ctx.plan.backward(grads))


class _AverageInputGrads(torch.autograd.Function):
    """Identity on the call's tensor inputs that require grad; backward averages their gradients over ranks.

    Rank ``r`` only differentiates through its own rows, so its gradient w.r.t. a global-batch input is partial;
    averaging (one all-reduce for all inputs, before they are sliced, so shapes agree) gives every rank the same
    gradient DDP gives the parameters: with ``gather_outputs`` the full-batch one (each rank's share carries the
    factor ``W``, see the module docstring), without it the mean over ranks of their local gradients.
    """

    @staticmethod
    def forward(ctx, group, world, comm_device, *tensors):
        ctx.group, ctx.world, ctx.comm_device = group, world, comm_device
        ctx.meta = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        out: list = [None] * len(grads)
        by_dtype: dict = {}
        for i, (_, dtype, _) in enumerate(ctx.meta):
            by_dtype.setdefault(dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            flat = [
                (grads[i] if grads[i] is not None else torch.zeros(ctx.meta[i][0], dtype=dtype))
                .reshape(-1)
                .to(ctx.comm_device)
                for i in idx
            ]
            buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            if buf.numel():
                dist.all_reduce(buf, group=ctx.group)
            buf /= ctx.world
            o = 0
            for i in idx:
                shape, _, device = ctx.meta[i]
                n = math.prod(shape)
                out[i] = buf[o : o + n].view(shape).to(device)
                o += n
        return (None, None, None) + tuple(out)


class _ExchangePlan:
    """Everything every rank knows about one exchange: per leaf its kind, axis, per-rank rows and weight."""

    def __init__(self, group, comm_device, rank, world, kinds, axes, rows, weights, shapes, dtypes, devices):
        self.group = group
        self.comm_device = comm_device
        self.rank = rank
        self.world = world
        self.kinds = kinds  # "cat" | "red" per tensor
        self.axes = axes  # axis for "cat" (0 for 0-dim, after unsqueeze)
        self.rows = rows  # per "cat" tensor: rows along the axis per rank (0 for inactive ranks)
        self.weights = weights  # per "red" tensor: this rank's factor c_r
        self.shapes = shapes  # local shapes
        self.dtypes = dtypes
        self.devices = devices

    # forward ------------------------------------------------------------------------------------------------
    def forward(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        outs: list[Tensor | None] = [None] * len(tensors)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for dtype, idx in by_dtype.items():
            cat = [i for i in idx if self.kinds[i] == "cat"]
            red = [i for i in idx if self.kinds[i] == "red"]
            if cat:
                self._gather(tensors, cat, dtype, outs)
            if red:
                self._reduce(tensors, red, dtype, outs)
        return outs  # type: ignore[return-value]

    def _moved(self, t: Tensor, i: int) -> Tensor:
        """A "cat" tensor with its axis first (a 0-dim tensor becomes one row)."""
        return t.reshape(1) if t.dim() == 0 else t.movedim(self.axes[i], 0)

    def _gather(self, tensors, cat, dtype, outs) -> None:
        # per rank r, the flat numel of each leaf: rows[r] * (numel of one row)
        row_numel = {}
        for i in cat:
            m = self._moved(tensors[i], i)
            row_numel[i] = math.prod(m.shape[1:])
        per_rank = [sum(self.rows[i][r] * row_numel[i] for i in cat) for r in range(self.world)]
        width = max(per_rank)
        mine = [self._moved(tensors[i], i).reshape(-1)[: self.rows[i][self.rank] * row_numel[i]] for i in cat]
        buf = torch.zeros(width, dtype=dtype, device=self.comm_device)
        if per_rank[self.rank]:
            buf[: per_rank[self.rank]] = torch.cat([m.to(self.comm_device) for m in mine])
        if width:
            bufs = [torch.empty_like(buf) for _ in range(self.world)]
            dist.all_gather(bufs, buf, group=self.group)
        else:
            bufs = [buf] * self.world
        offs = [0] * self.world
        for i in cat:
            m = self._moved(tensors[i], i)
            pieces = []
            for r in range(self.world):
                n = self.rows[i][r] * row_numel[i]
                if self.rows[i][r]:
                    pieces.append(bufs[r][offs[r] : offs[r] + n].view((self.rows[i][r],) + tuple(m.shape[1:])))
                offs[r] += n
            full = torch.cat(pieces, 0) if pieces else m.new_empty((0,) + tuple(m.shape[1:]))
            full = full.to(self.devices[i])
            outs[i] = full if tensors[i].dim() == 0 else full.movedim(0, self.axes[i])

    def _reduce(self, tensors, red, dtype, outs) -> None:
        flat = []
        for i in red:
            t = tensors[i].reshape(-1).to(self.comm_device)
            w = self.weights[i]
            flat.append(torch.zeros_like(t) if w == 0 else (t if w == 1 else t * w))
        buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
        dist.all_reduce(buf, group=self.group)
        o = 0
        for i in red:
            n = math.prod(self.shapes[i])
            outs[i] = buf[o : o + n].view(self.shapes[i]).to(self.devices[i])
            o += n

    # backward -----------------------------------------------------------------------------------------------
    def backward(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        out: list[Tensor | None] = [None] * len(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in range(len(grads)):
            if self.dtypes[i].is_floating_point or self.dtypes[i].is_complex:
                by_dtype.setdefault(self.dtypes[i], []).append(i)
        for dtype, idx in by_dtype.items():
            flat = []
            for i in idx:
                g = grads[i]
                flat.append(g.reshape(-1).to(self.comm_device))  # materialized: zeros where unused
            buf = torch.cat(flat) if len(flat) > 1 else flat[0].clone()
            if buf.numel():
                dist.all_reduce(buf, group=self.group)  # Σ over ranks of ∂L_r/∂(gathered output)
            o = 0
            for i in idx:
                n = grads[i].numel()
                g = buf[o : o + n].view(grads[i].shape).to(self.devices[i])
                o += n
                if self.kinds[i] == "red":
                    w = self.weights[i]
                    out[i] = torch.zeros(self.shapes[i], dtype=dtype, device=self.devices[i]) if w == 0 else g * w
                else:  # this rank's rows of the summed gradient
                    start = sum(self.rows[i][: self.rank])
                    n_rows = self.rows[i][self.rank]
                    if len(self.shapes[i]) == 0:
                        out[i] = g[start] if n_rows else torch.zeros((), dtype=dtype, device=self.devices[i])
                        continue
                    axis = self.axes[i]
                    mine = g.narrow(axis, start, n_rows)
                    if mine.shape[axis] != self.shapes[i][axis]:  # inactive rank: its (full-input) rows don't count
                        z = torch.zeros(self.shapes[i], dtype=dtype, device=self.devices[i])
                        out[i] = z
                    else:
                        out[i] = mine
        return out


def _fingerprint(items: Sequence[Any]) -> int:
    h = hashlib.blake2b(repr(list(items)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


# ---------------------------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------------------------


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """``torch.nn.parallel.DistributedDataParallel`` that takes the global batch and dpfast's ``in_dims``/``out_dims``.

    Args:
        module, device_ids, output_device: as for torch's DDP (one device per process: ``device_ids=[local_rank]``
            on GPUs, ``None`` on the CPU).
        in_dims, out_dims, dim, chunk_sizes: as for :class:`dpfast.DataParallel`, with ranks in place of devices
            (``chunk_sizes`` has one relative weight per rank).
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
        gather_outputs: bool = False,
        check_batch: Any = True,
        **ddp_kwargs: Any,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if check_batch not in (True, False, "values"):
            raise ValueError(f"check_batch must be True, False or 'values', got {check_batch!r}")
        # Everything about the specs is checked before torch's DDP broadcasts anything.
        specs = ArgumentSpecs(forward_of(module), in_dims, dim)
        validate_spec(out_dims, "out_dims", allow_reductions=True)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "dpfast.DistributedDataParallel needs torch.distributed: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment for it)"
            )
        super().__init__(module, device_ids=device_ids, output_device=output_device, dim=dim, **ddp_kwargs)
        self.in_dims = in_dims
        self.out_dims = out_dims
        self.chunk_sizes = chunk_sizes
        self.gather_outputs = bool(gather_outputs)
        self.check_batch = check_batch
        self._specs = specs
        self._rank = dist.get_rank(self.process_group)
        self._world = dist.get_world_size(self.process_group)
        self._weights = validate_chunk_sizes(chunk_sizes, self._world)
        backend = str(dist.get_backend(self.process_group)).lower()
        if "nccl" in backend:
            self._comm_device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._comm_device = torch.device("cpu")
        self.share: Share | None = None
        self._ghost: tuple[tuple, dict] | None = None

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
        local_error: BaseException | None = None
        batch: int | None = None
        mapped: list[Mapped] = []
        tree: ArgumentTree | None = None
        try:
            # binding can fail on one rank only (a structure that does not match its spec): that rank must reach
            # the agreement below too, or the others wait there for it
            tree = ArgumentTree(self._specs, inputs, kwargs)
            mapped = mapped_leaves(tree)
            batch = check_batch(tree, self._specs, mapped)
        except (ScatterError, TypeError, ValueError) as exc:
            local_error = exc
        if self.check_batch:
            self._agree(tree, mapped, batch, local_error)
        elif local_error is not None:
            raise local_error
        assert tree is not None

        W, r = self._world, self._rank
        subs = self._average_input_grads(tree)
        if batch:  # B > 0: split by the plan DataParallel would make over W devices
            sizes = split_sizes(batch, W, self._weights)
            start = sum(sizes[:r])
            self.share = Share(r, W, batch, tuple(sizes), start, start + sizes[r])
            self._ghost = None
            try:
                args, kw = _take(tree, mapped, start, sizes[r], sizes, r, subs)
            except ValueError:  # an empty share of a PackedSequence: straight to the ghost
                args, kw = inputs, kwargs
                self._ghost = (tree, mapped, sizes, False, subs)
            else:
                if not sizes[r]:
                    self._ghost = (tree, mapped, sizes, True, subs)
        else:  # nothing to split, or B == 0: every rank runs the whole input; rank 0's outputs count
            sizes = []
            self.share = Share(r, W, batch, (), 0, batch or 0)
            args, kw = _take(tree, [], 0, 0, [], 0, subs) if subs else (inputs, kwargs)
            self._ghost = None
        outputs = super().forward(*args, **kw)
        if not self.gather_outputs:
            return outputs
        return self._gather(outputs)

    def _average_input_grads(self, tree: ArgumentTree) -> dict:
        """The call's tensor inputs that require grad, seen through one :class:`_AverageInputGrads` node."""
        if not torch.is_grad_enabled():
            return {}
        leaves = [leaf for leaf in tree.leaves if isinstance(leaf.value, Tensor) and leaf.value.requires_grad]
        if not leaves:
            return {}
        views = _AverageInputGrads.apply(
            self.process_group, self._world, self._comm_device, *[leaf.value for leaf in leaves]
        )
        return {id(leaf): v for leaf, v in zip(leaves, views)}

    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Inside torch's DDP forward (between its pre- and post-forward): an empty share runs an empty slice, or
        a ghost when the module refuses an empty batch."""
        if self._ghost is None:
            return super()._run_ddp_forward(*inputs, **kwargs)
        tree, mapped, sizes, try_empty, subs = self._ghost
        if try_empty:  # `inputs` is the empty slice, already moved to the device by DDP's pre-forward
            try:
                return super()._run_ddp_forward(*inputs, **kwargs)
            except Exception:  # the module cannot take B = 0: run one real sample below, and count none of it
                pass
        ghost_sizes = [1] + [0] * (len(sizes) - 1)
        args, kw = _take(tree, mapped, 0, 1, ghost_sizes, 0, subs)
        if self.device_ids:  # as DDP's pre-forward moves inputs
            moved_args, moved_kw = _to_kwargs(
                args, kw, torch.device(self.device_type, self.device_ids[0]), self.use_side_stream_for_tensor_copies
            )
            args, kw = moved_args[0], moved_kw[0]
        out = super()._run_ddp_forward(*args, **kw)
        return self._zero_ghost(out)

    def _zero_ghost(self, out: Any) -> Any:
        spec = self.dim if self.out_dims is None else self.out_dims
        leaves: list[SpecLeaf] = []
        tdef = match_spec(out, spec, "output", self.dim, self.out_dims is not None, "out_dims", leaves)
        values = []
        for leaf in leaves:
            v, s = leaf.value, leaf.spec
            if isinstance(v, Tensor):
                if isinstance(s, int) and v.dim() > 0 and -v.dim() <= s < v.dim():
                    v = v.narrow(s % v.dim(), 0, 0)
                elif v.is_floating_point() or v.is_complex():
                    v = _ZeroOut.apply(v)
                else:
                    v = torch.zeros_like(v)
            elif isinstance(v, numbers.Number) and isinstance(s, str):
                v = type(v)(0)
            values.append(v)
        return unflatten(tdef, values)

    # -- agreeing on the batch ------------------------------------------------------------------------------

    def _local_summary(
        self,
        tree: ArgumentTree | None,
        mapped: Sequence[Mapped],
        batch: int | None,
        error: BaseException | None,
    ) -> str:
        if error is not None:
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            return f"{type(error).__name__}: {first}"
        parts = [f"B = {batch if batch is not None else '-'}"]
        for m in mapped:
            parts.append(f"{m.leaf.path} {shape_text(m.leaf.value)}")
        return ", ".join(parts)

    def _agree(
        self,
        tree: ArgumentTree | None,
        mapped: Sequence[Mapped],
        batch: int | None,
        error: BaseException | None,
    ) -> None:
        items: list[Any] = [self._specs.signature_text]
        if tree is not None:
            items += [tree.n_args, tree.kw_keys]
        by_leaf = {id(m.leaf): m for m in mapped}
        for leaf in tree.leaves if tree is not None else ():
            v = leaf.value
            m = by_leaf.get(id(leaf))
            if m is not None:
                if m.is_packed:
                    items.append((leaf.path, "packed", m.size, str(v.data.dtype), tuple(v.data.shape[1:])))
                else:
                    items.append((leaf.path, repr(leaf.spec), tuple(v.shape), str(v.dtype), v.requires_grad))
                if self.check_batch == "values":
                    t = (v.data if m.is_packed else v).detach().contiguous().cpu()
                    items.append(
                        hashlib.blake2b(t.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()
                    )
            else:
                kind = f"tensor(requires_grad={v.requires_grad})" if isinstance(v, Tensor) else type(v).__name__
                items.append((leaf.path, repr(leaf.spec), kind))
        status = 1 if error is not None else 0
        mine = torch.tensor(
            [status, -1 if batch is None else batch, _fingerprint(items)], dtype=torch.int64, device=self._comm_device
        )
        allv = [torch.empty_like(mine) for _ in range(self._world)]
        dist.all_gather(allv, mine, group=self.process_group)
        rows = [tuple(int(x) for x in t.tolist()) for t in allv]
        if all(row == rows[0] for row in rows) and status == 0:
            return
        # Everyone saw the same rows, so everyone is here: one more collective for a readable message.
        summaries: list[Any] = [None] * self._world
        dist.all_gather_object(summaries, self._local_summary(tree, mapped, batch, error), group=self.process_group)
        bad_local = [r for r, row in enumerate(rows) if row[0]]
        if bad_local:
            head = (
                f"rank{'s' if len(bad_local) > 1 else ''} {', '.join(map(str, bad_local))} could not split "
                "its inputs, so no rank runs this step"
            )
        else:
            bs = sorted({row[1] for row in rows})
            if len(bs) > 1:
                head = (
                    "the ranks were given different global batches: B differs across ranks "
                    f"({', '.join('-' if b < 0 else str(b) for b in bs)}); every rank must get the same "
                    "global batch (or load per-rank data and use dpfast.distributed.shard_batch / "
                    "shard_dataset with torch's DistributedDataParallel)"
                )
            else:
                what = (
                    "shapes, dtypes or structure" if self.check_batch is True else "shapes, dtypes, structure or values"
                )
                head = (
                    f"the ranks were given different global batches: same B = {bs[0]} but different {what} "
                    "of the arguments; every rank must get the same global batch"
                )
        lines = [f"dpfast.DistributedDataParallel: {head}"]
        for r, s in enumerate(summaries):
            lines.append(f"  rank {r}{' (this rank)' if r == self._rank else ''}: {s}")
        msg = "\n".join(lines)
        if error is not None:
            raise DistributedBatchError(msg + "\n" + str(error)) from error
        raise DistributedBatchError(msg)

    # -- gathering outputs ----------------------------------------------------------------------------------

    def _gather(self, out: Any) -> Any:
        share = self.share
        W, r = self._world, self._rank
        if share.sizes:
            active = [s > 0 for s in share.sizes]
            mean_w = [s / share.batch_size for s in share.sizes]
        else:
            active = [i == 0 for i in range(W)]
            mean_w = [1.0 if i == 0 else 0.0 for i in range(W)]
        spec = self.dim if self.out_dims is None else self.out_dims
        leaves: list[SpecLeaf] = []
        tdef = None
        # classify the leaves; numbers under "sum"/"mean" travel as 0-dim tensors
        desc: list[Any] = []
        tensors: list[Tensor] = []
        kinds: list[str] = []
        slots: list[Any] = []  # per leaf: ("keep",) | ("t", index, number_type or None)
        axes: list[int] = []
        weights: list[float] = []
        # An output this rank cannot gather (its own structure or shape) is reported through the exchange below,
        # so that every rank raises instead of the others waiting in it.
        local_error: BaseException | None = None
        try:
            tdef = match_spec(out, spec, "output", self.dim, self.out_dims is not None, "out_dims", leaves)
            for leaf in leaves:
                v, s = leaf.value, leaf.spec
                if v is None or s is None:
                    desc.append((leaf.path, "keep", repr(s), v is None))
                    slots.append(("keep",))
                    continue
                if isinstance(s, str):
                    if isinstance(v, Tensor):
                        t, num = v, None
                    elif isinstance(v, numbers.Number) and not isinstance(v, bool):
                        num = type(v) if s == "sum" and isinstance(v, int) else float
                        t = torch.tensor(v, dtype=torch.int64 if num is int else torch.float64)
                    else:
                        raise TypeError(
                            f"output `{leaf.path}` is a {type(v).__name__}; out_dims {s!r} needs "
                            "tensors or numbers from every rank"
                        )
                    desc.append((leaf.path, s, tuple(t.shape), str(t.dtype)))
                    slots.append(("t", len(tensors), num))
                    tensors.append(t)
                    kinds.append("red")
                    axes.append(0)
                    weights.append(mean_w[r] if s == "mean" else (1.0 if active[r] else 0.0))
                    continue
                if isinstance(v, PackedSequence):
                    raise TypeError(
                        f"output `{leaf.path}` is a PackedSequence, which gather_outputs cannot "
                        "all-gather yet; return it padded (torch.nn.utils.rnn.pad_packed_sequence), or "
                        "give it out_dims None to keep this rank's own value"
                    )
                if not isinstance(v, Tensor):
                    raise TypeError(
                        f"output `{leaf.path}` is a {type(v).__name__}, which cannot be concatenated "
                        f"along axis {s}; give it out_dims None (this rank's value), 'sum' or 'mean'"
                    )
                if v.dim() and not -v.dim() <= s < v.dim():
                    raise ValueError(
                        f"output `{leaf.path}` has shape {tuple(v.shape)}: axis {s} is out of range; "
                        "give it another out_dims axis, or None/'sum'/'mean'"
                    )
                axis = s % v.dim() if v.dim() else 0
                desc.append(
                    (
                        leaf.path,
                        "cat",
                        axis,
                        v.dim(),
                        str(v.dtype),
                        tuple(n for i, n in enumerate(v.shape) if i != axis),
                    )
                )
                slots.append(("t", len(tensors), None))
                tensors.append(v)
                kinds.append("cat")
                axes.append(axis)
                weights.append(1.0)
        except (TypeError, ValueError) as exc:
            local_error = exc
            desc = [("error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")]
            tensors, kinds, axes = [], [], []

        # one small all-gather: structure fingerprint and the rows of every "cat" tensor
        n_cat = sum(1 for k in kinds if k == "cat")
        meta = [_fingerprint(desc), n_cat, 0 if local_error is None else 1]
        for t, k, a in zip(tensors, kinds, axes):
            if k == "cat":
                meta.append((1 if t.dim() == 0 else t.shape[a]) if active[r] else 0)
        # n_cat is in the fingerprint's structure, so equal fingerprints mean equal lengths; lengths are checked
        # by a first fixed-size exchange only when they could differ.
        head = torch.tensor(meta[:3], dtype=torch.int64, device=self._comm_device)
        heads = [torch.empty_like(head) for _ in range(W)]
        dist.all_gather(heads, head, group=self.process_group)
        if any(not torch.equal(h, heads[0]) or int(h[2]) for h in heads):
            summaries: list[Any] = [None] * W
            dist.all_gather_object(summaries, [d for d in desc], group=self.process_group)
            failed = [i for i, h in enumerate(heads) if int(h[2])]
            if failed:
                lines = [
                    f"dpfast.DistributedDataParallel(gather_outputs=True): rank{'s' if len(failed) > 1 else ''} "
                    f"{', '.join(map(str, failed))} could not gather {'their' if len(failed) > 1 else 'its'} "
                    "outputs, so no rank gathers them"
                ]
            else:
                lines = [
                    "dpfast.DistributedDataParallel(gather_outputs=True): the ranks returned different output "
                    "structures (paths, specs, dtypes or non-batch shapes differ); every rank must return the "
                    "same structure to be gathered"
                ]
            for i, s in enumerate(summaries):
                lines.append(f"  rank {i}{' (this rank)' if i == r else ''}: {s}")
            if local_error is not None:
                raise type(local_error)("\n".join(lines) + "\n" + str(local_error)) from local_error
            raise ValueError("\n".join(lines))
        rows_per_cat: list[list[int]] = []
        if n_cat:
            body = torch.tensor(meta[3:], dtype=torch.int64, device=self._comm_device)
            bodies = [torch.empty_like(body) for _ in range(W)]
            dist.all_gather(bodies, body, group=self.process_group)
            table = [b.tolist() for b in bodies]
            rows_per_cat = [[table[q][j] for q in range(W)] for j in range(n_cat)]
        assert tdef is not None
        rows: list[list[int] | None] = []
        j = 0
        for k in kinds:
            if k == "cat":
                rows.append(rows_per_cat[j])
                j += 1
            else:
                rows.append(None)

        if not tensors:
            return out
        plan = _ExchangePlan(
            self.process_group,
            self._comm_device,
            r,
            W,
            kinds,
            axes,
            rows,
            weights,
            [tuple(t.shape) for t in tensors],
            [t.dtype for t in tensors],
            [t.device for t in tensors],
        )
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            results = _Exchange.apply(plan, *tensors)
        else:
            results = plan.forward(tensors)
        values = []
        for leaf, slot in zip(leaves, slots):
            if slot[0] == "keep":
                values.append(leaf.value)
                continue
            res = results[slot[1]]
            values.append(res.item() if slot[2] is int else (float(res.item()) if slot[2] is float else res))
        return unflatten(tdef, values)

    def extra_repr(self) -> str:
        parts = [f"world_size={self._world}"]
        for name in ("in_dims", "out_dims", "chunk_sizes"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)!r}")
        if self.gather_outputs:
            parts.append("gather_outputs=True")
        return ", ".join(parts)
