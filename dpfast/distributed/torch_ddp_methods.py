"""What code written for torch's DDP calls on the wrapper besides ``forward``, kept as torch does it with the step's
check on: pickling and ``copy.deepcopy``, comm hooks (with torch's bookkeeping), and ``join()`` for uneven inputs.

The check rides in DDP's first gradient bucket as a comm hook of dpfast's own (:mod:`~dpfast.distributed.bucket_check`);
it is not the user's hook: ``_get_ddp_logging_data()["comm_hook"]`` names only the user's, and the user may register
one hook (or a built-in one) as with torch.

Under ``join()`` a rank whose inputs ran out runs torch's join hook, which shadows DDP's collectives, the first
gradient bucket's included: its hook then sends a ``JOINED`` row, which the other ranks do not compare.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import JoinHook

# what a process holds of its own ranks' state (the group, the step's check, the last call): rebuilt on unpickling
_PER_PROCESS = ("_group", "_checks", "_bucket_check", "_call")


class _CheckedJoinHook(JoinHook):
    """torch's DDP join hook, with this rank's check rows marked ``JOINED`` while it shadows the others' steps."""

    def __init__(self, ddp: Any, torch_hook: JoinHook) -> None:
        self.ddp, self.torch_hook = ddp, torch_hook

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._checks.joined = True  # the check's hook sends a JOINED row (and, averaging over the active, a 0)
        check = ddp._bucket_check
        if check is not None:
            check.average_over_active(not ddp._divide_by_initial_world_size)
        self.torch_hook.main_hook()
        if check is not None:
            check.read()  # the shadowed backward ran the check's hook outside a backward: nothing read it

    def post_hook(self, is_last_joiner: bool) -> None:
        self.torch_hook.post_hook(is_last_joiner)
        ddp = self.ddp
        ddp._checks.joined = False
        ddp._checks.records = []  # forwards the other ranks compared without this rank's


class TorchDDPMethods:
    """A mixin of :class:`~dpfast.distributed.DistributedDataParallel`, placed before torch's class so that
    ``super()`` reaches torch's methods. It uses the wrapper's ``_install_checks`` and its check's state."""

    _bucket_check: Any
    _checks: Any
    gather_outputs: bool
    check_batch: Any

    def __getstate__(self) -> dict:
        """torch's state (without the process group, reducer and logger), without this process's check state."""
        attrs = super().__getstate__()  # type: ignore[misc]
        for name in _PER_PROCESS:
            attrs.pop(name, None)
        return attrs

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # type: ignore[misc]  # torch's: the default group, a new reducer
        self._install_checks()  # type: ignore[attr-defined]

    def register_comm_hook(self, state: object, hook: Any) -> None:
        """torch's ``register_comm_hook``: ``hook`` communicates every gradient bucket.

        With the checks on (and no ``gather_outputs``) the step's check rides in the first bucket: ``hook`` still
        runs on every bucket, and the check's table takes one small all-reduce beside the first bucket's.

        Args:
            state: passed to ``hook`` with each bucket, as in torch.
            hook: ``hook(state, bucket) -> Future``, as in torch.

        Raises:
            RuntimeError: a hook was registered already (torch allows one), with torch's message.
        """
        if self._bucket_check is None:
            return super().register_comm_hook(state, hook)  # type: ignore[misc]
        self._check_comm_hook(hook)  # type: ignore[attr-defined]
        self._bucket_check.set_user_hook(state, hook)
        self.logger._set_comm_hook_name(hook.__qualname__)  # type: ignore[attr-defined]
        self._comm_hooks.append((hook, state))  # type: ignore[attr-defined]

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's built-in hooks (``ALLREDUCE``, ``FP16_COMPRESS``), by their Python twins beside the check."""
        if self._bucket_check is None:
            return super()._register_builtin_comm_hook(comm_hook_type)  # type: ignore[misc]
        hook = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }[comm_hook_type]
        self._bucket_check.set_user_hook(self.process_group, hook)  # type: ignore[attr-defined]
        self.logger._set_comm_hook_name(str(comm_hook_type))  # type: ignore[attr-defined]

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Any:
        """torch's ``join()`` context manager, for ranks whose inputs run out at different steps.

        The step's check goes on: a joined rank's row is not compared, and the first call is checked with its
        first backward instead of before it runs (a rank that has joined would not take part).

        Args:
            divide_by_initial_world_size: as in torch: average gradients over the initial world size (``True``)
                or over the ranks that have not joined.
            enable: as in torch; ``False`` makes the context a no-op.
            throw_on_early_termination: as in torch.

        Returns:
            torch's join context manager.

        Raises:
            ValueError: ``enable`` with ``gather_outputs=True``: every forward then exchanges outputs, which a
                joined rank cannot shadow.
        """
        if enable and self.gather_outputs:
            raise ValueError(
                "DistributedDataParallel.join() lets ranks stop calling forward, but with gather_outputs=True every "
                "forward exchanges its outputs with every rank: build the wrapper with gather_outputs=False to use "
                "join(), or give every rank the same number of batches (e.g. drop_last=True in the sampler)"
            )
        return super().join(divide_by_initial_world_size, enable, throw_on_early_termination)  # type: ignore[misc]

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """torch's join hook, which marks this rank's check rows as joined while it shadows the other ranks.

        Args:
            **kwargs: torch's (``divide_by_initial_world_size``).

        Returns:
            The hook ``torch.distributed.algorithms.Join`` runs.

        Raises:
            Nothing beyond torch's.
        """
        hook = super().join_hook(**kwargs)  # type: ignore[misc]
        return _CheckedJoinHook(self, hook) if self.check_batch else hook

    def _sync_join_mode(self) -> bool:
        """Whether a join() context governs this forward (torch keeps it on after the context ends, as DDP does);
        with divide_by_initial_world_size=False the check's hook averages over the ranks that have not joined."""
        joining = bool(self._join_config.enable)  # type: ignore[attr-defined]
        if self._bucket_check is not None:
            self._bucket_check.average_over_active(joining and not getattr(self, "_divide_by_initial_world_size", True))
        return joining
