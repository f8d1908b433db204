"""When the ranks check that they agree, without a collective of its own on an ordinary step.

Every forward appends this rank's :class:`~dpfast.distributed.agreement.StepRecord` to a chain. The chain's row,
``(status, fingerprint, forwards)``, travels with a collective the step runs anyway and is compared there:

* with ``gather_outputs``, in the header of the output all-gather (in forward);
* without it, in DDP's first gradient bucket (:mod:`dpfast.distributed.bucket_check`), read when ``backward()``
  ends, before any optimizer step can use the gradients (under ``no_sync()`` the chain grows until the next
  synchronized backward);
* under ``torch.no_grad()`` without ``gather_outputs`` no collective runs, so one small all-gather checks the
  forward (:func:`~dpfast.distributed.agreement.agree_now`); so does the first call, before its forward.

Until a check, every rank runs its own plan, so nothing a rank does before it may depend on the others agreeing:
the collectives of a step must be the same on every rank whatever the batches. A rank that cannot run its part
(it could not plan its call, or its module refused its empty share) still issues them: the collectives its last
checked forward issued (:attr:`StepChecks.trace`, replayed by :func:`~dpfast.distributed.keeping_step.replay`),
then the check, where its status makes every rank raise.
"""

from __future__ import annotations

from collections.abc import Sequence

from .agreement import StepRecord, agree_now, chain_row, raise_disagreement, rows_agree
from .exchanges import RankGroup


class StepChecks:
    """One wrapper's checks: the forwards since the last check, and what the last checked step established (the
    collectives its forward issued, and the first rank that had rows, which DDP's buffers come from)."""

    def __init__(self, group: RankGroup, enabled: bool):
        self.group = group
        self.enabled = enabled
        self.records: list[StepRecord] = []
        self.checked_once = False
        self.trace: list[tuple] | None = None  # None until a checked forward recorded one
        self.buffer_source = 0
        self.sizes_exchanged = False  # per-rank inputs: the last checked step read every rank's row count
        self._pending_trace: list[tuple] | None = None
        self._pending_source = 0
        self._pending_sizes = False

    def begin(self, record: StepRecord) -> None:
        """A forward starts: its record joins the chain (the first call checks it at once, before running)."""
        if not self.enabled:
            return
        if not self.checked_once:  # nothing ran yet: a bad first call raises on every rank before it runs
            agree_now(self.group.process_group, self.group.comm_device, [record])
            self.checked_once = True
        self.records.append(record)  # how the forward ends (it may still fail) is checked with the step

    def ran(self, trace: list[tuple] | None, buffer_source: int) -> None:
        """What this forward did, kept until its check says it is what every rank did."""
        self._pending_trace, self._pending_source, self._pending_sizes = trace, buffer_source, False

    def exchanged_sizes(self) -> None:
        """This step read every rank's row count (a collective outside the forward: part of its pattern)."""
        self._pending_sizes = True

    def row(self) -> list[int]:
        """This rank's ``(status, fingerprint, forwards)``; zeros when the checks are off."""
        return chain_row(self.records) if self.enabled else [0, 0, 0]

    def verify(self, rows: Sequence[Sequence[int]]) -> None:
        """Every rank's row (the same list on every rank): return if they agree, else raise on every rank."""
        if not self.enabled:
            return
        records, self.records = self.records, []
        if not rows_agree(rows):
            raise_disagreement(self.group.process_group, records, rows)
        self._commit()

    def agreed(self) -> None:
        """Every rank's row is this rank's, and says OK (compared where the rows are: the C++ hook)."""
        if not self.enabled:
            return
        self.records = []
        self._commit()

    def check_now(self) -> None:
        """A blocking check of the chain (the first call, and forwards no other collective can carry)."""
        if not self.enabled:
            return
        records, self.records = self.records, []
        agree_now(self.group.process_group, self.group.comm_device, records)
        self._commit()

    def _commit(self) -> None:
        if self._pending_trace is not None:
            self.trace = self._pending_trace
        self.buffer_source = self._pending_source
        self.sizes_exchanged = self._pending_sizes
