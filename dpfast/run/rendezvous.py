"""How one call's replicas take turns on a device and meet at collectives.

Replicas that share a device run one at a time, in a fixed order, so a rehearsal on one device is deterministic
(random draws come in the same order every run) and pays no thread hand-off: while no replica calls a collective,
a device's replicas all run inline in one thread, one after another. At a collective a replica deposits its
tensor and hands its device's turn to the next replica, which then gets a thread of its own (from the pool).
When every replica of the call has deposited, each device's turn goes to its lowest-index replica again, and each
replica builds its result from the deposits. Replicas on different devices run concurrently, as on real GPUs.

A replica that raises, or returns, while others wait in a collective (or before one they later enter) fails that
collective for them with a :class:`CollectiveError` naming it: nothing hangs. Once a collective failed, every
later one of the call fails at once.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any, Callable

import torch

_UNSTARTED, _RUNNING, _BLOCKED, _READY, _DONE = range(5)
_LOCAL = threading.local()


class CollectiveError(RuntimeError):
    """Raised by ``dpfast.all_gather``/``all_reduce`` (and ``SyncBatchNorm``) when a collective cannot complete.

    The replicas of a call called different collectives at the same point, gave tensors that do not fit together,
    or one of them returned or raised without reaching the collective the others wait in: never a hang. When another
    replica's exception is the cause, the call re-raises that root cause instead.

    Args:
        message: what went wrong, naming the replicas and the collective.
        secondary: whether another replica's exception is the cause (the call then raises that one).

    Attributes:
        secondary: as given.
    """

    __module__ = "dpfast"  # printed and pickled as dpfast.CollectiveError, the name users catch it by

    def __init__(self, message: str, secondary: bool = False):
        super().__init__(message)
        self.secondary = secondary


@dataclasses.dataclass(eq=False)
class Collective:
    """One collective of a call: what was called, and each replica's deposit."""

    seq: int  # the how-many-th collective of the call (from 1)
    what: tuple  # e.g. ("all_gather", dim) or ("all_reduce", op)
    values: dict = dataclasses.field(default_factory=dict)  # replica index -> tensor
    done: bool = False
    error: BaseException | None = None


def describe(what: tuple) -> str:
    name, arg = what
    return f"{name}(dim={arg})" if name == "all_gather" else f"{name}(op={arg!r})"


class Call:
    """The replicas of one DataParallel call: their turns per device and the collectives they meet at.

    ``run(i)`` runs replica ``i``'s forward and returns its exception (or None); ``spawn(fn, device)`` runs
    ``fn`` on a worker thread set up for ``device``. :meth:`run_all` returns when every replica is done.
    """

    def __init__(
        self,
        devices: Sequence[torch.device],
        run: Callable[[int], BaseException | None],
        spawn: Callable[[Callable[[], None], torch.device], None],
        check: Callable[[Collective, Sequence[torch.device]], str | None] | None = None,
        turn_ended: Callable[[int], None] | None = None,
    ):
        self.n = len(devices)
        self.devices = list(devices)
        self._run = run
        self._spawn = spawn
        self._check = check  # validates a complete collective's deposits: an error message or None
        self._turn_ended = turn_ended  # told when a replica gives up its device's turn (still holding it)
        # entered through its lock (a Condition's own __enter__ is Python code): the same lock, held as cond wants
        self._lock = threading.RLock()
        self.cond = threading.Condition(self._lock)
        self._waiting = 0  # threads waiting on cond (changed holding it): no one to wake, no notify
        self.progress = [_UNSTARTED] * self.n  # per replica: _UNSTARTED, _RUNNING, _BLOCKED, _READY or _DONE
        self.left = [""] * self.n  # how a done replica left: "returned" or "raised <type>"
        # per distinct device, its replicas in index order; per replica, the index of its device in on_device
        self.on_device, self.device_of, self._after = _groups(tuple(self.devices))
        self.baton: list[int | None] = [None] * len(self.on_device)
        self.entered = [0] * self.n
        self.open: Collective | None = None
        self.broken: CollectiveError | None = None
        self.start_errors: dict[int, BaseException] = {}  # replicas whose worker thread could not be started

    def _wait(self) -> None:
        """Wait on cond (held) until another thread wakes it."""
        self._waiting += 1
        try:
            self.cond.wait()
        finally:
            self._waiting -= 1

    def _wake(self) -> None:
        """Wake every thread waiting on cond (held); a thread that has not begun to wait reads the state first."""
        if self._waiting:
            self.cond.notify_all()

    # -- running -----------------------------------------------------------------------------------------------

    def run_all(self) -> None:
        """Every device's replicas: the first device's in this thread, the others' on workers (concurrently)."""
        for g in range(1, len(self.on_device)):
            first = self._start(g)
            try:
                self._spawn(lambda g=g, first=first: self._run_group(g, first), self.devices[first])
            except Exception as exc:  # noqa: BLE001 - as in _pass
                with self._lock:
                    self._could_not_start(g, first, exc)
        self._run_group(0, self._start(0))
        with self._lock:
            try:
                while self.progress.count(_DONE) != self.n:
                    self._wait()
            except BaseException as exc:  # Ctrl-C while this thread waits: no replica starts after it
                self._stop(type(exc).__name__)
                raise

    def _stop(self, why: str) -> None:
        """A KeyboardInterrupt (any BaseException that is not an Exception) stops the call at once: unstarted
        replicas never start, and replicas waiting in a collective are released from it. Called holding cond."""
        for j in range(self.n):
            if self.progress[j] == _UNSTARTED:
                self.progress[j] = _DONE
                self.left[j] = "never started (the call was interrupted)"
        if self.open is not None and not self.open.done:
            self._fail(self.open, CollectiveError(f"the call was interrupted ({why})", secondary=True))
        elif self.broken is None:
            self.broken = CollectiveError(f"the call was interrupted ({why})", secondary=True)
        self._wake()

    def _could_not_start(self, g: int, j: int, exc: BaseException) -> None:
        """Replica ``j`` never ran (its thread could not start): it has left, and the turn moves on."""
        self.start_errors[j] = exc
        self.progress[j] = _DONE
        self.left[j] = f"could not start ({type(exc).__name__})"
        self._settle()
        if self.baton[g] == j:
            self._pass(g, j, free=False)
        self._wake()

    def _start(self, g: int) -> int:
        with self._lock:
            first = self.on_device[g][0]
            self.baton[g] = first
            self.progress[first] = _RUNNING
            return first

    def _run_group(self, g: int, i: int | None) -> None:
        """Run replica ``i`` here, then whichever unstarted replica of the device gets the turn after it."""
        previous = getattr(_LOCAL, "call", None)
        turn_ended = self._turn_ended
        while i is not None:
            _LOCAL.call = (self, i)
            try:
                exc = self._run(i)
                left = "returned" if exc is None else f"raised {type(exc).__name__}"
                stop = exc is not None and not isinstance(exc, Exception)
                del exc  # this frame is the f_back of one in exc's traceback: naming exc would make a cycle
            finally:
                _LOCAL.call = previous
            if turn_ended is not None:
                turn_ended(i)
            with self._lock:
                self.progress[i] = _DONE
                self.left[i] = left
                if stop:
                    self._stop(left.replace("raised ", "", 1))
                if self.open is not None:
                    self._settle()  # a collective this replica left behind fails, and may hand the turn on itself
                i = self._pass(g, i, free=True) if self.baton[g] == i else None
                self._wake()

    def _pass(self, g: int, after: int, free: bool) -> int | None:
        """Give device ``g``'s turn to the next replica after ``after`` that can run. An unstarted one runs in this
        thread when it is ``free`` (returned: then its index is returned), else on a new worker."""
        for j in self._after[after]:
            if self.progress[j] in (_UNSTARTED, _READY):
                self.baton[g] = j
                if self.progress[j] == _READY:
                    self._wake()  # its own thread is waiting for the turn
                    return None
                self.progress[j] = _RUNNING
                if free:
                    return j
                try:
                    self._spawn(lambda j=j: self._run_group(g, j), self.devices[j])
                except Exception as exc:  # noqa: BLE001 - e.g. no thread can be started: that replica fails
                    self._could_not_start(g, j, exc)
                return None
        self.baton[g] = None
        return None

    # -- collectives -------------------------------------------------------------------------------------------

    def enter(self, i: int, what: tuple, value: Any) -> Collective:
        """Replica ``i`` deposits ``value``; returns the collective once every replica has, and it is ``i``'s turn.
        Raises :class:`CollectiveError` if the collective cannot complete."""
        g = self.device_of[i]
        if self._turn_ended is not None:
            self._turn_ended(i)
        with self._lock:
            self.entered[i] += 1
            if self.broken is not None:
                raise CollectiveError(str(self.broken), secondary=True) from None
            coll = self.open
            if coll is None:
                coll = self.open = Collective(self.entered[i], what)
            self.progress[i] = _BLOCKED
            if coll.what != what:
                first = min(coll.values)
                self._fail(
                    coll,
                    CollectiveError(
                        f"collective #{coll.seq} differs across replicas: replica {first} called "
                        f"{describe(coll.what)}, replica {i} called {describe(what)}; every replica must call the "
                        "same collectives in the same order"
                    ),
                )
            else:
                coll.values[i] = value
                self._settle()
                if not coll.done:
                    self._pass(g, i, free=False)
            while not (coll.done and self.baton[g] == i):
                self._wait()
            self.progress[i] = _RUNNING
            if coll.error is not None:
                # a fresh exception per replica: the stored one raised in several threads would collect all their
                # frames, and its traceback would hold this Call (a cycle keeping every replica's tensors alive)
                raise CollectiveError(str(coll.error), secondary=coll.error.secondary) from None
            return coll

    def _settle(self) -> None:
        """Complete or fail the open collective if every replica has either deposited or left."""
        coll = self.open
        if coll is None or coll.done:
            return
        missing = [j for j in range(self.n) if j not in coll.values]
        gone = [j for j in missing if self.progress[j] == _DONE]
        if gone:
            raised = [j for j in gone if self.left[j] != "returned"]
            who = ", ".join(f"replica {j} on {self.devices[j]} {self.left[j]}" for j in gone)
            verb = "before reaching" if raised else "without calling"
            entered = ", ".join(map(str, sorted(coll.values)))
            self._fail(
                coll,
                CollectiveError(
                    f"{describe(coll.what)} (collective #{coll.seq} of the call) cannot complete: {who} {verb} it, "
                    f"which replica(s) {entered} entered; every replica must call the same collectives in the same "
                    "order",
                    secondary=bool(raised),
                ),
            )
        elif not missing:
            problem = self._check(coll, self.devices) if self._check is not None else None
            if problem is not None:
                self._fail(coll, CollectiveError(f"{describe(coll.what)} (collective #{coll.seq}): {problem}"))
            else:
                self._finish(coll)

    def _fail(self, coll: Collective, error: CollectiveError) -> None:
        coll.error = error
        self.broken = error
        self._finish(coll)

    def _finish(self, coll: Collective) -> None:
        """Mark the collective done and give each device's turn to its lowest-index waiting replica."""
        coll.done = True
        self.open = None
        for g, members in enumerate(self.on_device):
            ready = [j for j in members if self.progress[j] == _BLOCKED]
            for j in ready:
                self.progress[j] = _READY
            holder = self.baton[g]
            # A replica that holds the turn keeps it: one still running (a failure can come from another device
            # mid-turn) or one handed it but not yet awake. Else the lowest-index waiting replica goes first.
            if ready and (holder is None or holder in ready or self.progress[holder] == _DONE):
                self.baton[g] = ready[0]
        self._wake()


@functools.lru_cache(maxsize=64)
def _groups(devices: tuple[torch.device, ...]) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], tuple]:
    """The replicas of each distinct device of ``devices``, in index order; each replica's device group; and for
    each replica, its group's members in the order the turn goes round after it (it last)."""
    on_device: list[list[int]] = []
    device_of: list[int] = []
    seen: dict[torch.device, int] = {}
    for i, d in enumerate(devices):
        g = seen.setdefault(d, len(seen))
        if g == len(on_device):
            on_device.append([])
        on_device[g].append(i)
        device_of.append(g)
    after = []
    for i, g in enumerate(device_of):
        members = on_device[g]
        k = members.index(i)
        after.append(tuple(members[k + 1 :] + members[: k + 1]))
    return tuple(map(tuple, on_device)), tuple(device_of), tuple(after)


class _Solo:
    """The context of a call with one replica: every collective is the identity."""

    n = 1


SOLO = _Solo()


def current() -> tuple[Any, int] | None:
    """``(call, replica index)`` of the replica running in this thread, or None outside a DataParallel call."""
    return getattr(_LOCAL, "call", None)


class solo_context:
    """Run one replica as a call of one (collectives are the identity, replica_index() is 0)."""

    def __enter__(self) -> None:
        self.previous = getattr(_LOCAL, "call", None)
        _LOCAL.call = (SOLO, 0)

    def __exit__(self, *exc: Any) -> None:
        _LOCAL.call = self.previous
