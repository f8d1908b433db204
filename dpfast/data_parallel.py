"""``dpfast.DataParallel``: specs -> plan -> scatter -> replicas -> execute -> gather.

A drop-in for ``torch.nn.DataParallel``, and a subclass of it (same constructor, attributes and ``state_dict``
keys; ``isinstance`` is how HF Trainer, accelerate, PEFT and Lightning find ``.module``) that takes the batch axis
per input (``in_dims``) and the gather axis or reduction per output (``out_dims``), never drops a sample, and checks
every input before anything is copied or run. torch's hooks ``scatter``, ``replicate``, ``parallel_apply`` and
``gather`` work with these semantics, and a subclass that overrides any of them is run through them, as torch does.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn

from .ext.op_checks import DeviceLike
from .ext.torch_compat import run_by_dynamo_as_it_is
from .move.gather import gather_outputs
from .move.scatter import move_tree, scatter_tree
from .plan.batch_errors import whole_sequence_hint
from .plan.call_plan import CallPlan, passthrough_plan, plan_call
from .run.attributes import SettingsAttributes
from .run.execute import run_replicas
from .run.replica_copies import refuse_unreplicable
from .run.replicas import Lease, ReplicaCache, replicate_once
from .run.settings import NAMES, Settings, check_given_device_ids, resolve_device
from .run.workers import WorkerPool
from .trees.binding import forward_of
from .trees.specs import Spec

__all__ = ["DataParallel"]


_HOOKS = ("scatter", "replicate", "parallel_apply", "gather")
# What this thread's last DataParallel.scatter() split, per instance: the replicas' sizes (for "mean" in gather())
# and devices (for replicate() and parallel_apply() in a forward that runs through the hooks).
_LAST_SCATTER = threading.local()


def _scatter_records() -> weakref.WeakKeyDictionary:
    records = getattr(_LAST_SCATTER, "records", None)
    if records is None:
        records = _LAST_SCATTER.records = weakref.WeakKeyDictionary()
    return records


def _run_leased(lease: Lease, run: Callable[[], list]) -> list:
    """``run()``'s outputs; the lease ends with them (leased on to their graph), or interrupted."""
    try:
        outputs = run()
    except Exception:
        lease.end()
        raise
    except BaseException:  # KeyboardInterrupt: a replica may still be running on a worker
        lease.end(interrupted=True)
        raise
    lease.end(outputs)
    return outputs


def _split(plan: CallPlan) -> tuple[list[torch.device], list[int], list[tuple[tuple, dict]]]:
    """The devices, chunk sizes and ``(args, kwargs)`` of the replicas a plan runs: what forward and the
    ``scatter()`` hook both run (a plan that splits nothing is one call on the first device)."""
    if plan.mode == "split":
        replicas = plan.replicas
        devices = [d for _, d, _ in replicas]
        sizes = [s for _, _, s in replicas]
        return devices, sizes, scatter_tree(plan.tree, sizes, devices)
    source = plan.devices[0]
    return [source], [plan.batch_size or 0], [move_tree(plan.tree, source)]


class DataParallel(SettingsAttributes, nn.DataParallel):
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

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``; ``dim``, a spec or a ``cost`` is of the wrong type, or
            names a parameter ``module.forward`` does not have (the message lists the known names); a compiled
            module, or opacus' per-sample-gradient module, over several devices: its replicas cannot be made
            (compile the wrapper instead: ``torch.compile(dpfast.DataParallel(model, ...))``; ``plan()`` and the
            call raise it too, for a module compiled after the wrapper was built).
        ValueError: a device that is not ``"cpu"`` or an available CUDA device, ``chunk_sizes`` of another length
            than ``device_ids`` or with a negative weight, an unknown ``out_dims`` reduction.

    What a call does, and raises, is ``forward``'s (and ``plan()`` shows it first): in short, ``B`` is the size most
    top-level arguments agree on, the chunks always sum to it (no sample is dropped) and go to the devices in
    order, and every input is checked before anything is copied. The guides give the details: specs and
    ``plan()``, the rehearsal, structured inputs (dataclasses, namedtuples, mappings, pytree nodes, KV caches,
    ``PackedSequence``, jagged nested tensors, ``"items"``) and cost-balanced splits.
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
        # persistent replicas (copies on other devices, refreshed each step) and workers (one per slot after the
        # first); both go with this instance (deleting it stops the workers) and start afresh in a copy or pickle
        self._replicas = ReplicaCache()
        self._pool = WorkerPool(max_idle=0)
        # Everything about the settings is checked now, against forward's signature; only the structure of each
        # call's values is left to check per call.
        check_given_device_ids(device_ids)
        values = dict(zip(NAMES, (device_ids, output_device, dim, in_dims, out_dims, chunk_sizes, cost)))
        self._use(Settings(module, values))
        if self._copies_module(self._settings.devices):
            refuse_unreplicable(module)  # (plan() and the call raise it too, for a module compiled later)
        if len(self._settings.devices) == 1:
            self.module.to(self._settings.devices[0])  # as torch does for a single device

    # -- the call ------------------------------------------------------------------------------------------------

    def _plan_call(self, inputs: tuple, kwargs: dict, settings: Settings | None = None) -> CallPlan:
        """The call's plan under ``settings`` (the forward's own, just checked), or the settings now."""
        s = self._current_settings() if settings is None else settings
        if not s.devices:
            return passthrough_plan(forward_of(self.module), inputs, kwargs)
        self._replicas.check_module(self.module, s.devices[0], self._copies_module(s.devices))
        return self._plan_on(s.devices, inputs, kwargs, s)

    def _copies_module(self, devices: Sequence[torch.device]) -> bool:
        """Whether a call over ``devices`` copies the module into dpfast's replicas (a subclass overriding
        ``replicate()`` makes its own, and decides what it can copy)."""
        return len(devices) > 1 and type(self).replicate is DataParallel.replicate

    def _plan_on(
        self, devices: list[torch.device], inputs: tuple, kwargs: dict, settings: Settings | None = None
    ) -> CallPlan:
        """The plan of a call split over ``devices`` (``chunk_sizes`` weigh the wrapper's own devices only), under
        ``settings`` (default: the settings now)."""
        s = self._settings_or_now() if settings is None else settings
        weights = s.weights if devices == s.devices else None
        return plan_call(
            s.specs, inputs, kwargs, len(devices), weights,
            devices=devices, output_device=s.output_device, cost=s.cost,
        )  # fmt: skip

    @run_by_dynamo_as_it_is
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Split the call's batch over ``device_ids``, run a replica of ``module`` per chunk, and gather.

        Call the wrapper (``dp(x, h, mask=m)``) rather than ``forward``, as with any module. ``plan(*inputs,
        **kwargs)`` shows what this call does without copying or running anything. Every error about the arguments
        is raised before anything is copied or run, as ``plan()`` raises it; only ``out_dims``, which needs the
        outputs, is checked after the replicas ran (before anything is gathered).

        Args:
            *inputs: ``module.forward``'s positional arguments. Each is split along its batch axis as ``in_dims``
                says (``dim`` where it says nothing), or replicated whole under a ``None`` spec.
            **kwargs: ``module.forward``'s keyword arguments, treated as ``in_dims`` names them, exactly as if
                they were passed by position.

        Returns:
            The replicas' outputs combined as ``out_dims`` says (concatenated along an int spec, reduced by
            ``"sum"``/``"mean"``, replica 0's value under ``None``) on ``output_device``, with the structure and
            types ``module`` returned. With one device, or with no CUDA and no ``device_ids``, ``module``'s own
            output, as torch returns it.

        Raises:
            dpfast.ScatterError: the tensors mapped to a batch axis disagree on the batch size ``B``, or have no
                such axis (out of range); the message lists every mapped tensor's path, shape and axis and
                suggests an ``in_dims``.
            TypeError: a spec does not match the structure of its argument, or an explicit int spec holds a
                non-tensor.
            ValueError: an input is on a device of another type than ``device_ids``, the costs of ``cost`` are
                bad (wrong length, negative, NaN), or the replicas' outputs do not fit their ``out_dims`` spec.
            dpfast.CollectiveError: replicas called ``dpfast.all_gather``/``all_reduce`` (or SyncBatchNorm) in
                different orders, with tensors that do not fit together, or not at all.
            Exception: whatever a replica raised, re-raised with the replica's index and device in the message
                (the same type where it can be built from a message, else ``RuntimeError``) and the original
                chained as its cause.
        """
        settings = self._current_settings()  # (checked once a call: it compares every attribute with the last)
        if not settings.devices:
            return self.module(*inputs, **kwargs)
        if type(self) is not DataParallel and any(
            getattr(type(self), h) is not getattr(DataParallel, h) for h in _HOOKS
        ):
            return self._run_through_hooks(inputs, kwargs)
        return self._run(self._plan_call(inputs, kwargs, settings))

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
            lease = self._replicas.lease(self.module, source, devices)
            hint = functools.partial(whole_sequence_hint, plan.tree, plan.batch_size)
            outputs = _run_leased(lease, lambda: run_replicas(lease.modules, inputs_per_replica, devices, self._pool,
                                                              lease.watch, hint))  # fmt: skip
        s, out_dims = self._settings_or_now(), self.out_dims
        off_axis = plan.tree.program.off_axis
        return gather_outputs(outputs, out_dims, self.dim, s.output_device, sizes, s.outputs_for(out_dims), off_axis)

    # -- torch.nn.DataParallel's hooks, with dpfast's semantics -----------------------------------------------------

    def _run_through_hooks(self, inputs: tuple, kwargs: dict) -> Any:
        """torch's forward: scatter -> replicate -> parallel_apply -> gather, for a subclass overriding any of them."""
        self._replicas.check_module(self.module, self._devices[0], self._copies_module(self._devices))
        args, kws = self.scatter(inputs, kwargs, self.device_ids)
        if len(self._devices) == 1:
            return self.module(*args[0], **kws[0])
        devices = self._scattered(len(args))[1]
        if type(self).replicate is not DataParallel.replicate:
            outputs = self.parallel_apply(self.replicate(self.module, devices), args, kws)
        else:  # not overridden: the persistent replicas
            lease = self._replicas.lease(self.module, self._devices[0], devices)
            outputs = _run_leased(lease, lambda: self.parallel_apply(lease.modules, args, kws))
        return self.gather(outputs, self.output_device)

    def _scattered(self, n: int) -> tuple[list[int], list[torch.device]]:
        """Sizes and devices of this thread's last scatter() of this instance if it made ``n`` chunks, else equal
        shares on the first ``n`` devices (as torch assumes)."""
        last = _scatter_records().get(self)
        if last is not None and len(last[0]) == n:
            return last
        return [1] * n, self._devices[:n]

    def scatter(self, inputs: tuple, kwargs: dict | None, device_ids: Sequence[DeviceLike]) -> tuple[tuple, tuple]:
        """Split a call's arguments by ``in_dims`` (and ``cost``) over ``device_ids``: torch's hook, dpfast's plan.

        Args:
            inputs: the call's positional arguments.
            kwargs: its keyword arguments (``None``: none).
            device_ids: the devices to split over, as the constructor takes them.

        Returns:
            ``(args, kwargs)``: one tuple of positional arguments and one dict of keyword arguments per replica
            that runs, each on its device. The chunks sum to ``B``: no sample is dropped.

        Raises:
            ValueError: ``device_ids`` is empty or a single device rather than a sequence; and the errors a call
                raises before anything is copied (``ScatterError``, the spec errors).
        """
        self._current_settings()
        if isinstance(device_ids, (str, int, torch.device)) or not device_ids:
            raise ValueError(
                f"device_ids must be a non-empty sequence of devices (e.g. [0, 1] or ['cpu'] * 2), got {device_ids!r}"
            )
        devices = [resolve_device(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
        run, sizes, parts = _split(self._plan_on(devices, inputs, kwargs or {}))
        _scatter_records()[self] = (sizes, run)
        return tuple(a for a, _ in parts), tuple(k for _, k in parts)

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        """One module per device, as a call makes them: torch's hook, dpfast's replicas.

        Args:
            module: the module to replicate (its parameters on one device).
            device_ids: one entry per replica; repeats allowed.

        Returns:
            ``module`` itself first on its own device, then a replica with buffers of its own for every other entry
            (sharing the parameters on the same device, a broadcast copy on another CUDA device).

        Raises:
            ValueError: an entry of ``device_ids`` is not ``"cpu"`` or an available CUDA device.
        """
        devices = [resolve_device(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
        source = next(iter(module.parameters()), None)
        source = source.device if source is not None else (self._devices[0] if self._devices else devices[0])
        return replicate_once(module, source, devices)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """Run ``replicas[i](*inputs[i], **kwargs[i])`` concurrently on this wrapper's workers: torch's hook.

        Args:
            replicas: one module per replica, as :meth:`replicate` makes them.
            inputs: one argument tuple per replica (a single value is one argument), as :meth:`scatter` makes them.
            kwargs: one keyword dict per replica, or ``None`` for none.

        Returns:
            The replicas' outputs, in replica order; each replica ran on the device the last :meth:`scatter` sent
            its chunk to.

        Raises:
            ValueError: ``replicas``, ``inputs`` and ``kwargs`` differ in length (nothing is run).
            Exception: what a replica raised, re-raised with the replica's index and device in the message.
        """
        n = len(replicas)
        kwargs = tuple(kwargs) if kwargs else ({},) * n
        if len(inputs) != n or len(kwargs) != n:
            raise ValueError(
                f"parallel_apply got {n} replicas, {len(inputs)} inputs and {len(kwargs)} kwargs: give one input "
                "(and one kwargs dict, or none at all) per replica, as scatter() and replicate() over the same "
                "device_ids make them; nothing was run (no chunk of the batch may be dropped)"
            )
        args = [tuple(a) if isinstance(a, (list, tuple)) else (a,) for a in inputs]
        return run_replicas(list(replicas), list(zip(args, kwargs)), self._scattered(n)[1], self._pool)

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        """Combine the replicas' outputs as ``out_dims`` says: torch's hook, dpfast's specs.

        Args:
            outputs: the replicas' outputs, in replica order.
            output_device: where the result goes (``-1``: the CPU, as in torch).

        Returns:
            The combined output, with the structure and types the replicas returned; ``"mean"`` weights each
            replica by its share of the last :meth:`scatter`'s batch.

        Raises:
            TypeError, ValueError: an output does not fit its ``out_dims`` spec (the message names the output).
        """
        self._current_settings()
        device = torch.device("cpu") if output_device == -1 else resolve_device(output_device, "output_device")
        return gather_outputs(list(outputs), self.out_dims, self.dim, device, self._scattered(len(outputs))[0])

    def plan(self, *inputs: Any, **kwargs: Any) -> CallPlan:
        """What ``self(*inputs, **kwargs)`` would do; nothing is copied or run.

        Args:
            *inputs: the call's positional arguments, as for :meth:`forward`.
            **kwargs: its keyword arguments.

        Returns:
            The very plan the call executes: ``str(plan)`` is a table of every argument leaf with its shape, spec
            and per-replica chunk (and, with ``cost``, each device's cost).

        Raises:
            dpfast.ScatterError, TypeError, ValueError: the errors the call would raise before copying anything,
                as :meth:`forward` lists them.
        """
        return self._plan_call(inputs, kwargs)

    def extra_repr(self) -> str:
        """The settings ``repr()`` shows: ``device_ids`` and what differs from the defaults.

        Returns:
            ``"device_ids=[cpu, cpu], in_dims={'h': 1}"`` and the like.

        Raises:
            Nothing: it reads the public attributes only.
        """
        ids, out = self.device_ids or [], self.output_device  # the public attributes (a fresh unpickle resolves later)
        parts = [f"device_ids=[{', '.join(str(d) for d in ids)}]"]
        if out is not None and ids and out != ids[0]:
            parts.append(f"output_device={out}")
        if self.dim != 0:
            parts.append(f"dim={self.dim}")
        for name in ("in_dims", "out_dims", "chunk_sizes"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)!r}")
        return ", ".join(parts)
