"""``dpfast.DataParallel``: specs -> plan -> scatter -> replicas -> execute -> gather.

A drop-in for ``torch.nn.DataParallel``, and a subclass of it (same constructor, attributes and ``state_dict``
keys; ``isinstance`` is how HF Trainer, accelerate, PEFT and Lightning find ``.module``) that takes the batch axis
per input (``in_dims``) and the gather axis or reduction per output (``out_dims``), never drops a sample, and checks
every input before anything is copied or run. torch's hooks ``scatter``, ``replicate``, ``parallel_apply`` and
``gather`` work with these semantics, and a subclass that overrides any of them is run through them, as torch does.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from .ext.op_checks import DeviceLike
from .move.gather import gather_outputs
from .move.scatter import move_tree, scatter_tree
from .plan.call_plan import CallPlan, passthrough_plan, plan_call
from .plan.costs import CostSource
from .plan.splits import validate_chunk_sizes
from .run.execute import run_replicas
from .run.replicas import ReplicaCache, replicate_once
from .run.workers import WorkerPool
from .trees.binding import Binding, forward_of
from .trees.specs import Spec, validate_spec

__all__ = ["DataParallel"]


def _device(d: DeviceLike, what: str) -> torch.device:
    if isinstance(d, bool) or not isinstance(d, (int, str, torch.device)):
        raise TypeError(f"{what} must be an int, a string like 'cuda:1' or 'cpu', or a torch.device; got {d!r}")
    try:
        dev = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{what} is {d!r}, which is not a device: {exc}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{what} is {d!r} but CUDA is not available; use 'cpu' (device_ids=['cpu'] * n rehearses a "
                "multi-device run on the CPU)"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"{what} is {d!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type == "cpu":
        dev = torch.device("cpu")  # 'cpu:0' is the CPU: its tensors report device('cpu'), so compare to that
    else:
        raise ValueError(f"{what} is {d!r}; dpfast.DataParallel runs on 'cpu' and CUDA devices")
    return dev


def _public(dev: torch.device) -> int | torch.device:
    """How torch.nn.DataParallel exposes a device: its index for CUDA (we keep torch.device('cpu') for the CPU)."""
    return dev.index if dev.type == "cuda" else dev


_HOOKS = ("scatter", "replicate", "parallel_apply", "gather")
# What this thread's last DataParallel.scatter() split, per instance: the replicas' sizes (for "mean" in gather())
# and devices (for replicate() and parallel_apply() in a forward that runs through the hooks).
_LAST_SCATTER = threading.local()


def _scatter_records() -> weakref.WeakKeyDictionary:
    records = getattr(_LAST_SCATTER, "records", None)
    if records is None:
        records = _LAST_SCATTER.records = weakref.WeakKeyDictionary()
    return records


def _split(plan: CallPlan) -> tuple[list[torch.device], list[int], list[tuple[tuple, dict]]]:
    """The devices, chunk sizes and ``(args, kwargs)`` of the replicas a plan runs: what forward and the
    ``scatter()`` hook both run (a plan that splits nothing is one call on the first device)."""
    if plan.mode == "split":
        devices = [d for _, d, _ in plan.replicas]
        sizes = [s for _, _, s in plan.replicas]
        return devices, sizes, scatter_tree(plan.tree, sizes, devices)
    source = plan.devices[0]
    return [source], [plan.batch_size or 0], [move_tree(plan.tree, source)]


class DataParallel(nn.DataParallel):
    """Split each call's batch over ``device_ids``, run a replica of ``module`` per chunk, and gather.

    Replicas on different devices run concurrently; replicas sharing a device (a rehearsal: ``["cpu"] * 4``,
    ``[0, 0]``) run in turn and have buffers and attributes of their own, as separate devices would.

    Args:
        module: the module to run; its parameters and buffers must be on ``device_ids[0]``.
        device_ids: ints, ``"cuda:N"``, ``torch.device`` or ``"cpu"``; repeats allowed (``["cpu"] * 4`` rehearses a
            4-device run on the CPU). Default: every visible CUDA device; with no CUDA, the module is called directly.
        output_device: where outputs are gathered (default ``device_ids[0]``).
        dim: the batch axis of every input and output that ``in_dims``/``out_dims`` do not name.
        in_dims: batch axis per input: ``None`` (``dim`` for all), an int, a sequence by position, or a dict keyed by
            ``module.forward``'s parameter names. Specs are pytree prefixes: int, ``None`` (replicate), ``"items"``
            (a list/tuple of per-sample items, split by position), or tuple/list/dict mirroring the argument.
        out_dims: per output, as prefix specs: int (concatenate), ``None`` (replica 0's value), ``"sum"``, ``"mean"``
            (weighted by each replica's share of the batch), ``"items"`` (concatenate the replicas' sequences).
        chunk_sizes: relative weights per device (``0`` skips a device); default an even split.
        cost: balance work, not counts: the name of a ``forward`` parameter holding ``B`` per-sample costs
            (``"lengths"``), a path into one (``"batch['lengths']"``; a ``PackedSequence`` there means its
            sequence lengths), or a callable taking the call's arguments as ``forward`` does and returning them.
            The split stays contiguous and in order and minimizes the largest device cost (relative to
            ``chunk_sizes``); ``plan()`` shows each device's cost and the count split's.

    Behaviour worth knowing:
        * ``B`` is the size that most top-level arguments agree on along their batch axis (ties: the earliest
          argument); any mapped tensor that disagrees raises :class:`dpfast.ScatterError` before anything is
          copied, with a table of every mapped tensor (paths like ``x``, ``h[0]``, ``batch['mask']``, ``pair.a``
          rooted at forward's parameter names) and a suggested ``in_dims``.
        * Chunks differ by at most one (earlier devices take the remainder), or follow ``chunk_sizes`` by largest
          remainder; they always sum to ``B``. ``B`` < n runs fewer replicas; ``B == 0`` or nothing to split runs
          one call on ``device_ids[0]``.
        * A 0-dim output under an int spec is stacked into ``(n_replicas_run,)``, like torch. With a single
          device the module is called directly and its output returned as is, also like torch.
        * Non-tensors under the default ``dim`` reach every replica by reference; under an explicit int spec they
          are an error. A ``PackedSequence`` under an int spec is split by sequence, in the caller's order, and
          packed outputs are merged back by sequence; a jagged nested tensor is split along its batch axis 0.
          Dataclasses (also dict hybrids such as HF's ModelOutput, by their fields), namedtuples, mappings, torch
          pytree nodes and HF KV caches keep their type on the way in and out; a dataclass spec is a dict keyed by
          field names or an instance of that dataclass. channels_last stays channels_last.
        * Non-tensor outputs under an int spec come back once when every replica returned an equal value,
          otherwise as a list with one value per replica.
        * Inputs must be on the CPU or on devices of device_ids' type; anything else is refused before copying.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        in_dims: Any = None,
        out_dims: Spec = None,
        chunk_sizes: Sequence[float] | None = None,
        cost: str | Callable[..., Any] | None = None,
    ) -> None:
        # torch's __init__ resolves device_ids as CUDA indices (no "cpu" rehearsal) and moves the module: everything
        # it sets is set here instead, so only Module's __init__ runs
        nn.Module.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.dim = dim
        self.in_dims = in_dims
        self.out_dims = out_dims
        self.chunk_sizes = chunk_sizes
        # Everything about the specs is checked now, against forward's signature; only the structure of each
        # call's values is left to check per call.
        self._specs = Binding(forward_of(module), in_dims, dim)
        validate_spec(out_dims, "out_dims", allow_reductions=True)
        self.cost = cost
        self._cost = None if cost is None else CostSource(cost, self._specs)

        if device_ids is None and not torch.cuda.is_available():
            # like torch: no accelerator and nothing asked for -> call the module directly. output_device and the
            # number of chunk_sizes are ignored then (code written for N GPUs still runs), their types are not.
            if chunk_sizes is not None:
                n = len(chunk_sizes) if hasattr(chunk_sizes, "__len__") else 0
                validate_chunk_sizes(chunk_sizes, n)
            self.device_ids: list = []
            self.output_device = None
            self.src_device_obj = None
            self._devices: list[torch.device] = []
            self._output_device: torch.device | None = None
            self._weights = None
            return
        if device_ids is None:
            device_ids = list(range(torch.cuda.device_count()))
        if isinstance(device_ids, (str, int, torch.device)):
            raise ValueError(
                f"device_ids must be a non-empty sequence of devices (e.g. [0, 1] or ['cpu'] * 2), got {device_ids!r}"
            )
        try:
            device_ids = list(device_ids)
        except TypeError:
            raise TypeError(
                f"device_ids must be a non-empty sequence of devices (e.g. [0, 1] or ['cpu'] * 2), got "
                f"{type(device_ids).__name__} {device_ids!r}"
            ) from None
        if len(device_ids) == 0:
            raise ValueError(
                f"device_ids must be a non-empty sequence of devices (e.g. [0, 1] or ['cpu'] * 2), got {device_ids!r}"
            )
        devices = [_device(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
        if len({d.type for d in devices}) > 1:
            raise ValueError(
                f"device_ids mix device types ({', '.join(map(str, devices))}); use all CUDA devices, or 'cpu' "
                "repeated for a CPU rehearsal"
            )
        out = devices[0] if output_device is None else _device(output_device, "output_device")
        self._devices = devices
        self._output_device = out
        self._weights = validate_chunk_sizes(chunk_sizes, len(devices))
        self.device_ids = [_public(d) for d in devices]
        self.output_device = _public(out)
        self.src_device_obj = devices[0]
        # persistent replicas (copies on other devices, refreshed each step) and workers (one per slot after the
        # first); both go with this instance (deleting it stops the workers) and start afresh in a deep copy
        self._replicas = ReplicaCache()
        self._pool = WorkerPool(max_idle=len(devices) - 1)
        if len(devices) == 1:
            self.module.to(devices[0])  # as torch does for a single device

    # -- the call ------------------------------------------------------------------------------------------------

    def _plan_call(self, inputs: tuple, kwargs: dict) -> CallPlan:
        if not self._devices:
            return passthrough_plan(forward_of(self.module), inputs, kwargs)
        self._replicas.check_module_device(self.module, self._devices[0])
        return self._plan_on(self._devices, inputs, kwargs)

    def _plan_on(self, devices: list[torch.device], inputs: tuple, kwargs: dict) -> CallPlan:
        """The plan of a call split over ``devices`` (``chunk_sizes`` weigh the wrapper's own devices only)."""
        weights = self._weights if devices == self._devices else None
        return plan_call(
            self._specs, inputs, kwargs, len(devices), weights,
            devices=devices, output_device=self._output_device, cost=self._cost,
        )  # fmt: skip

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self._devices:
            return self.module(*inputs, **kwargs)
        if any(getattr(type(self), h) is not getattr(DataParallel, h) for h in _HOOKS):
            return self._run_through_hooks(inputs, kwargs)
        return self._run(self._plan_call(inputs, kwargs))

    def _run(self, plan: CallPlan) -> Any:
        """Execute a plan: scatter, replicas, run, gather (or the one-call paths)."""
        source = self._devices[0]
        if plan.mode == "direct":  # torch's single-device behaviour: the output is returned as the module gave it
            args, kw = move_tree(plan.tree, source)
            return self.module(*args, **kw)
        devices, sizes, inputs_per_replica = _split(plan)
        if plan.mode == "once":  # B == 0, or nothing to split: one call on device_ids[0]
            outputs = run_replicas([self.module], inputs_per_replica, devices)
        else:
            modules, done = self._replicas.replicate(self.module, source, devices)
            try:
                outputs = run_replicas(modules, inputs_per_replica, devices, self._pool)
            finally:
                done()
        return gather_outputs(outputs, self.out_dims, self.dim, self._output_device, sizes)

    # -- torch.nn.DataParallel's hooks, with dpfast's semantics -----------------------------------------------------

    def _run_through_hooks(self, inputs: tuple, kwargs: dict) -> Any:
        """torch's forward: scatter -> replicate -> parallel_apply -> gather, for a subclass overriding any of them."""
        self._replicas.check_module_device(self.module, self._devices[0])
        args, kws = self.scatter(inputs, kwargs, self.device_ids)
        if len(self._devices) == 1:
            return self.module(*args[0], **kws[0])
        devices = self._scattered(len(args))[1]
        done = None
        if type(self).replicate is DataParallel.replicate:  # not overridden: the persistent replicas
            replicas, done = self._replicas.replicate(self.module, self._devices[0], devices)
        else:
            replicas = self.replicate(self.module, devices)
        try:
            outputs = self.parallel_apply(replicas, args, kws)
        finally:
            if done is not None:
                done()
        return self.gather(outputs, self.output_device)

    def _scattered(self, n: int) -> tuple[list[int], list[torch.device]]:
        """Sizes and devices of this thread's last scatter() of this instance if it made ``n`` chunks, else equal
        shares on the first ``n`` devices (as torch assumes)."""
        last = _scatter_records().get(self)
        if last is not None and len(last[0]) == n:
            return last
        return [1] * n, self._devices[:n]

    def scatter(self, inputs: tuple, kwargs: dict | None, device_ids: Sequence[DeviceLike]) -> tuple[tuple, tuple]:
        """The call's ``(args per replica, kwargs per replica)``, split by ``in_dims`` (and ``cost``) over
        ``device_ids`` by the plan a call makes (never dropping a sample; the same errors, before anything is
        copied)."""
        if isinstance(device_ids, (str, int, torch.device)) or not device_ids:
            raise ValueError(
                f"device_ids must be a non-empty sequence of devices (e.g. [0, 1] or ['cpu'] * 2), got {device_ids!r}"
            )
        devices = [_device(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
        run, sizes, parts = _split(self._plan_on(devices, inputs, kwargs or {}))
        _scatter_records()[self] = (sizes, run)
        return tuple(a for a, _ in parts), tuple(k for _, k in parts)

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """One module per device, as a call makes them: ``module`` itself first on its own device, a replica with
        buffers of its own for every other entry (sharing the parameters on the same device, a broadcast copy on
        another CUDA device)."""
        devices = [_device(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
        source = next(iter(module.parameters()), None)
        source = source.device if source is not None else (self._devices[0] if self._devices else devices[0])
        return replicate_once(module, source, devices)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """Run ``replicas[i](*inputs[i], **kwargs[i])`` concurrently on this wrapper's workers (each on the device
        the last scatter() sent its chunk to), re-raising a failure with the replica and device named."""
        n = len(replicas)
        kwargs = tuple(kwargs) if kwargs else ({},) * n
        args = [tuple(a) if isinstance(a, (list, tuple)) else (a,) for a in inputs]
        return run_replicas(list(replicas), list(zip(args, kwargs)), self._scattered(n)[1], self._pool)

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        """Combine the replicas' outputs as ``out_dims`` says onto ``output_device`` (-1: the CPU, as in torch);
        ``"mean"`` weights each by its share of the last scatter()'s batch."""
        device = torch.device("cpu") if output_device == -1 else _device(output_device, "output_device")
        return gather_outputs(list(outputs), self.out_dims, self.dim, device, self._scattered(len(outputs))[0])

    def plan(self, *inputs: Any, **kwargs: Any) -> CallPlan:
        """What ``self(*inputs, **kwargs)`` would do, as a printable table; nothing is copied or run.

        It is the very plan the call executes, so it raises the same errors the call would raise before copying
        anything (``ScatterError``, ``TypeError``...).
        """
        return self._plan_call(inputs, kwargs)

    def extra_repr(self) -> str:
        parts = [f"device_ids=[{', '.join(str(d) for d in self.device_ids)}]"]
        if self._output_device is not None and self._devices and self._output_device != self._devices[0]:
            parts.append(f"output_device={self.output_device}")
        if self.dim != 0:
            parts.append(f"dim={self.dim}")
        for name in ("in_dims", "out_dims", "chunk_sizes"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)!r}")
        return ", ".join(parts)
