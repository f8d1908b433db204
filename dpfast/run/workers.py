"""The worker threads replicas run on: a small persistent pool per ``DataParallel``.

A pool keeps at most ``max_idle`` idle workers (one per device slot after the first: slot 0 runs in the caller).
It grows past that only while all its workers are busy (the same instance called from several threads at once, or
nested calls), so it cannot deadlock, and the extra workers exit when their task ends. Workers hold only a weak
reference to their pool: when the owner is deleted the pool is collected and its finalizer stops the idle workers
(and, via ``weakref.finalize``'s exit hook, at interpreter exit). A pool is per process: after a fork it starts
afresh.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from typing import Callable


class _Worker(threading.Thread):
    def __init__(self, pool: WorkerPool, name: str):
        super().__init__(name=name, daemon=True)
        self.pool = weakref.ref(pool)  # the owner's deletion must be able to collect the pool
        self.tasks: queue.SimpleQueue[tuple[Callable[[], None], threading.Event] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            item = self.tasks.get()
            if item is None:
                return
            fn, done = item
            item = None
            try:
                fn()
            except BaseException:  # pragma: no cover - run_replicas' work() stores every exception itself
                pass
            finally:
                fn = None  # the task's closure (its inputs and outputs) must not stay alive in an idle worker
                pool = self.pool()
                keep = pool is not None and pool._release(self)
                pool = None
                done.set()
            if not keep:
                return


def _stop(workers: list) -> None:
    """Finalizer of a pool: tell its idle workers to exit (busy ones exit when their task ends)."""
    for w in list(workers):
        w.tasks.put(None)
    me = threading.current_thread()
    for w in list(workers):
        if w is not me and w.is_alive():
            w.join(timeout=1.0)


class WorkerPool:
    """Idle workers are reused; a new one starts only when none is idle. At most ``max_idle`` are kept."""

    def __init__(self, max_idle: int = 32, name: str = "dpfast-worker"):
        self.max_idle = max_idle
        self.name = name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._pid = os.getpid()
        self._count = 0
        self._finalizer = weakref.finalize(self, _stop, self._idle)

    def __reduce__(self):  # deepcopy / pickle of the owning DataParallel: a fresh pool, no threads
        return (WorkerPool, (self.max_idle, self.name))

    def _after_fork(self) -> None:
        """In a forked child the parent's workers do not exist, and the lock may have been held by one of them at
        the fork (it would then stay locked forever here): start afresh. The child runs one thread at this point."""
        if self._pid != os.getpid():
            self._lock = threading.Lock()
            self._idle.clear()  # the same list object: the finalizer holds it
            self._all.clear()
            self._pid = os.getpid()

    def threads(self) -> list[_Worker]:
        """The live workers (tests read it)."""
        self._after_fork()
        with self._lock:
            return [w for w in self._all if w.is_alive()]

    def submit(self, fn: Callable[[], None], done: threading.Event) -> None:
        self._after_fork()
        with self._lock:
            worker = self._idle.pop() if self._idle else None
            if worker is None:
                self._count += 1
                worker = _Worker(self, f"{self.name}-{self._count}")
                self._all.append(worker)
                worker.start()
        worker.tasks.put((fn, done))

    def _release(self, worker: _Worker) -> bool:
        with self._lock:
            if self._pid == os.getpid() and len(self._idle) < self.max_idle and self._finalizer.alive:
                self._idle.append(worker)
                return True
            if worker in self._all:
                self._all.remove(worker)
            return False

    def shutdown(self) -> None:
        """Stop the idle workers now (the pool starts new ones on its next call)."""
        self._after_fork()
        with self._lock:
            idle = list(self._idle)
            self._idle.clear()
            for w in idle:
                self._all.remove(w)
        _stop(idle)
