"""Without ``gather_outputs``, the step's check rides in DDP's first gradient bucket: no collective is added.

DDP all-reduces each gradient bucket once per synchronized backward. Here the first bucket's all-reduce carries a
table of ``W`` rows after the gradients: rank ``r`` writes its check row (status, forwards, and the 64-bit
fingerprint in 16-bit pieces, or 8-bit ones for a 16-bit float bucket, so every value is exact in the bucket's
dtype) into row ``r`` and zeros elsewhere, so the sum is every rank's row. The table is read when ``backward()``
ends, after DDP's reducer waited for its buckets (so reading it waits for nothing), and a disagreement raises from
``backward()`` on every rank, before an optimizer step can use the gradients.

On CUDA reading the table would be a host-device sync; it is copied to pinned memory instead and read at the next
forward, so there a disagreement raises one step late.

A comm hook the user registers (:meth:`DistributedDataParallel.register_comm_hook`) still runs on every bucket;
the table then takes one all-reduce of its own, beside the first bucket's.

With the compiled extension and CPU buckets, :class:`NativeBucketCheck` runs the same protocol as a C++ comm hook
(``csrc/ddp_check_hook.cpp``): Python then runs twice a step, to give this rank's row and to take the result.
:class:`BucketCheck` (this module's Python hook) serves CUDA buckets, a user's hook, and the pure-Python fallback.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..ext.loader import C as _C
from .disagreement import JOINED, OK
from .group import RankGroup

_MASK64 = (1 << 64) - 1
HOOK_ONCE = "register_comm_hook or register_builtin_comm_hook can only be called once."  # torch's reducer's words


def _piece_bits(dtype: torch.dtype) -> int:
    return 8 if dtype in (torch.float16, torch.bfloat16) else 16


def _row_width(bits: int) -> int:
    return 2 + 64 // bits


def encode_row(row: Sequence[int], bits: int) -> list[int]:
    """``(status, fingerprint, forwards)`` as small non-negative integers, each below ``2 ** bits``."""
    status, fp, forwards = row
    fp &= _MASK64
    mask = (1 << bits) - 1
    return [status & mask, forwards & mask] + [(fp >> (bits * k)) & mask for k in range(64 // bits)]


def decode_row(values: Sequence[float], bits: int) -> list[int]:
    ints = [int(v) for v in values]
    fp = sum(piece << (bits * k) for k, piece in enumerate(ints[2:]))
    return [ints[0], fp - (1 << 64) if fp >> 63 else fp, ints[1]]


def decode_table(values: Sequence[float], bits: int, world: int) -> list[list[int]]:
    """Every rank's row of an all-reduced table."""
    k = _row_width(bits)
    return [decode_row(values[r * k : (r + 1) * k], bits) for r in range(world)]


class BucketCheck:
    """The comm hook carrying the check rows (see the module docstring). ``row()`` gives this rank's row when the
    first bucket is ready; once backward has ended, ``agreed()`` is called when every rank sent this rank's row and
    it says OK (one comparison of the table), else ``verify(rows)`` gets every rank's rows (and raises on every
    rank when they disagree)."""

    def __init__(
        self,
        group: RankGroup,
        row: Callable[[], list[int]],
        verify: Callable[[list[list[int]]], None],
        agreed: Callable[[], None] | None = None,
    ) -> None:
        self.group = group
        self.row = row
        self.verify = verify
        self.agreed = agreed  # every rank's row is this rank's, which says OK: verify's outcome, without decoding
        self.user_hook: tuple[Any, Callable] | None = None
        # join(divide_by_initial_world_size=False): gradients are averaged over the ranks that have not joined
        self.divide_by_active = False
        # (all-reduced buffer, table offset, bits, work to wait for or None, the table if every rank agrees)
        self._pending: tuple[torch.Tensor, int, int, Any, torch.Tensor | None] | None = None
        # CUDA: (pinned table, event, bits, the table if every rank agrees)
        self._deferred: tuple[torch.Tensor, Any, int, torch.Tensor | None] | None = None
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # -> (buffer, its table's view)
        # (row, bits, dtype, device) -> the table with this rank's row alone, on the device; and on the host, the
        # table every rank agreeing on an OK row sums to (None unless this rank's row says OK)
        self._last_row: tuple[tuple, torch.Tensor, torch.Tensor | None] | None = None

    def hook(self, state, bucket):  # unannotated: DDP checks annotations, and these would be strings here
        """The comm hook: the first bucket carries the table; the others are DDP's default (or the user's).
        A sparse first bucket (``nn.Embedding(sparse=True)``) and a user's hook leave the bucket as it is: the
        table then takes an all-reduce of its own."""
        buf = bucket.buffer()
        if bucket.index() == 0:
            if self.user_hook is None and not buf.is_sparse:
                return self._with_table(buf)
            self._table_alone(buf)
        if self.user_hook is not None:
            return self.user_hook[1](self.user_hook[0], bucket)
        if self.divide_by_active and not buf.is_sparse:
            with torch.no_grad():
                running = 0.0 if self.row()[0] == JOINED else 1.0  # a joined rank shadows the bucket with zeros
                full = torch.cat([buf, buf.new_full((1,), running)])  # + this rank's count
            fut = dist.all_reduce(full, group=self.group.process_group, async_op=True).get_future()
            return fut.then(lambda f: _sum_over_count(f.value()[0]))
        # as DDP's reducer (bit for bit): times 1 / W, a sparse bucket divided by W; in place (a graph's step too)
        buf.div_(self.group.world) if buf.is_sparse else buf.mul_(1.0 / self.group.world)
        fut = dist.all_reduce(buf, group=self.group.process_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    def _with_table(self, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """The first bucket's gradients with the table after them, in one all-reduce."""
        n, bits, w = buf.numel(), _piece_bits(buf.dtype), self.group.world
        full = self._table(n, buf.dtype, buf.device, bits)
        graph = buf.requires_grad  # backward(create_graph=True): scaled in place as the reducer does, for its graph
        if graph:
            buf.mul_(1.0 / w)
        with torch.no_grad():
            if self.divide_by_active or graph:  # join(divide_by_initial_world_size=False): over the active ranks
                full[:n].copy_(buf)
            else:
                torch.mul(buf, 1.0 / w, out=full[:n])  # as DDP's reducer: times 1 / W, then sum
        fut = dist.all_reduce(full, group=self.group.process_group, async_op=True).get_future()
        self._pending = (full, n, bits, None, self._agreeing())  # the reducer waits for fut before the read
        self._read_after_backward()
        if graph:
            return fut.then(lambda f: _copied_into(buf, f.value()[0][:n]))
        if not self.divide_by_active:
            return fut.then(lambda f: f.value()[0][:n])
        return fut.then(lambda f: _over_active(f.value()[0], n, w, _row_width(bits)))

    def _table(self, n: int, dtype: torch.dtype, device: torch.device, bits: int) -> torch.Tensor:
        """``n`` elements for the gradients, then the table with this rank's row filled in. The buffer is kept
        for the next step: DDP copies the gradients out, and the table is read, before the next backward."""
        g, k = self.group, _row_width(bits)
        kept = self._buffers.get((n, dtype, device))
        if kept is None:
            full = torch.empty(n + g.world * k, dtype=dtype, device=device)
            kept = self._buffers[(n, dtype, device)] = (full, full[n:])
        full, table = kept
        table.copy_(self._alone(tuple(self.row()), bits, dtype, device))  # one copy: the row and the others' zeros
        return full

    def _alone(self, row: tuple, bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The table with this rank's row alone, on the bucket's device; the same row (the same batch structure)
        step after step is made once. Onto a GPU it is copied from pinned memory, asynchronously: a copy from
        pageable memory would synchronize the host with the GPU's stream in every backward (torch's blocking copy
        waits for it)."""
        key = (row, bits, dtype, device)
        if self._last_row is None or self._last_row[0] != key:
            g, k = self.group, _row_width(bits)
            encoded = torch.tensor(encode_row(row, bits), dtype=dtype)
            host = torch.zeros(g.world * k, dtype=dtype)
            host[g.rank * k : (g.rank + 1) * k] = encoded
            agreeing = encoded.repeat(g.world) if row[0] == OK else None
            if device.type == "cuda":
                host = host.pin_memory()  # (torch's caching host allocator keeps it until the copy has run)
            self._last_row = (key, host.to(device, non_blocking=True), agreeing)
        return self._last_row[1]

    def _agreeing(self) -> torch.Tensor | None:
        """The table every rank's sum holds when each sent this rank's row (None when it does not say OK)."""
        return None if self._last_row is None else self._last_row[2]

    def _table_alone(self, buf: torch.Tensor) -> None:
        """The table in an all-reduce of its own, beside the first bucket's (a user's hook, a sparse bucket)."""
        bits = _piece_bits(buf.dtype)
        table = self._table(0, buf.dtype, buf.device, bits)
        work = dist.all_reduce(table, group=self.group.process_group, async_op=True)
        self._pending = (table, 0, bits, work, self._agreeing())
        self._read_after_backward()

    def _read_after_backward(self) -> None:
        """Read the table once DDP's reducer has finished the backward: a callback queued now runs before the
        reducer's own (queued when its last bucket is ready), so it queues the read behind it."""
        queue = torch.autograd.Variable._execution_engine.queue_callback
        with contextlib.suppress(RuntimeError):  # not in a backward: DDP shadowing one (the caller reads it)
            queue(lambda: queue(self.read))

    def read(self) -> None:
        """Check the rows of the last all-reduced table (on CUDA: copy them to the host, read at the next
        forward). A no-op when none is pending."""
        if self._pending is None:
            return
        full, n, bits, work, agreeing = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        table = full[n:]
        if table.is_cuda:
            host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
            host.copy_(table, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._deferred = (host, event, bits, agreeing)
            return
        self._check(table, bits, agreeing)

    def read_deferred(self) -> None:
        """CUDA: check the table the last backward copied to the host (its copy has long finished)."""
        if self._deferred is None:
            return
        host, event, bits, agreeing = self._deferred
        self._deferred = None
        event.synchronize()
        self._check(host, bits, agreeing)

    def _check(self, table: torch.Tensor, bits: int, agreeing: torch.Tensor | None) -> None:
        """Every rank's row of an all-reduced table (on the host): ``agreed()`` when each is this rank's OK row
        (one comparison), else every row decoded for ``verify``."""
        if agreeing is not None and self.agreed is not None and torch.equal(table, agreeing):
            self.agreed()
        else:
            self.verify(decode_table(table.tolist(), bits, self.group.world))

    def set_user_hook(self, state: object, hook: Callable) -> None:
        """The user's ``hook(state, bucket)`` communicates every bucket from now on (once: torch allows one)."""
        if self.user_hook is not None:
            raise RuntimeError(HOOK_ONCE)
        self.user_hook = (state, hook)

    def average_over_active(self, on: bool) -> None:
        """join(divide_by_initial_world_size=False): average the gradients over the ranks that have not joined."""
        self.divide_by_active = on


def _copied_into(buf: torch.Tensor, summed: torch.Tensor) -> torch.Tensor:
    """``buf`` holding the summed values, its graph kept: as the reducer's in-place all-reduce leaves it."""
    with torch.no_grad():
        return buf.copy_(summed)


def _sum_over_count(full: torch.Tensor) -> torch.Tensor:
    """A bucket summed over the ranks with their count last: the gradients' mean over the ranks that sent 1."""
    return full[:-1].div_(full[-1])


def _over_active(full: torch.Tensor, n: int, world: int, k: int) -> torch.Tensor:
    """The first bucket's summed gradients over the ranks whose table row is not JOINED (on the device: no sync)."""
    active = (full[n:].view(world, k)[:, 0] != JOINED).sum()
    return full[:n].div_(active)


def _sparse_gradients(module: torch.nn.Module) -> bool:
    """Whether DDP gives ``module`` sparse gradient buckets (as its reducer decides it)."""
    return any(isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse for m in module.modules())


def native_hook_available(module: torch.nn.Module, group: RankGroup) -> bool:
    """The C++ hook takes dense CPU buckets: a module whose parameters are all on the CPU, talking over the CPU."""
    if _C is None or not hasattr(_C, "_ddp_check_install") or group.comm_device.type != "cpu":
        return False
    return all(p.device.type == "cpu" for p in module.parameters()) and not _sparse_gradients(module)


class NativeBucketCheck:
    """:class:`BucketCheck`'s protocol as a C++ comm hook on ``reducer`` (``csrc/ddp_check_hook.cpp``).

    The hook asks ``row()`` for this rank's row when the first bucket is ready, and compares the all-reduced table
    when ``backward()`` ends: when every row is this rank's and says OK it calls ``agreed()``, else ``verify(rows)``
    (which raises on every rank). A hook the user registers later sends every bucket through :class:`BucketCheck`.
    """

    def __init__(
        self,
        reducer: Any,
        group: RankGroup,
        row: Callable[[], list[int]],
        verify: Callable[[list[list[int]]], None],
        agreed: Callable[[], None],
    ) -> None:
        self._python = BucketCheck(group, row, verify, agreed)
        # the callables reach neither this object nor the wrapper: the hook's state holds them, and no cycle
        # runs through it (a capsule is invisible to the garbage collector)
        on_table = functools.partial(_on_table, group.world, verify, agreed)
        self._state = _C._ddp_check_install(reducer, group.process_group, group.rank, group.world, row, on_table)

    @property
    def user_hook(self) -> tuple[Any, Callable] | None:
        return self._python.user_hook

    def set_user_hook(self, state: object, hook: Callable) -> None:
        """As :meth:`BucketCheck.set_user_hook`; the C++ hook hands every bucket to the Python one from now on."""
        self._python.set_user_hook(state, hook)
        _C._ddp_check_delegate(self._state, self._python.hook)

    def average_over_active(self, on: bool) -> None:
        """As :meth:`BucketCheck.average_over_active`, by the Python hook while it is on."""
        if on == self._python.divide_by_active:
            return
        self._python.average_over_active(on)
        if self._python.user_hook is None:
            _C._ddp_check_delegate(self._state, self._python.hook if on else None)

    def read(self) -> None:
        """Check a table no backward's end read (DDP's shadow of a backward runs the hook outside one)."""
        _C._ddp_check_read(self._state)
        self._python.read()

    def read_deferred(self) -> None:
        """Nothing is deferred on the CPU (the Python hook's, after a user hook: also nothing)."""
        self._python.read_deferred()

    @property
    def collectives(self) -> int:
        """The all-reduces the C++ hook issued (the Python hook's go through ``torch.distributed``)."""
        return int(_C._ddp_check_collectives(self._state))


def _on_table(world: int, verify: Callable, agreed: Callable, table: torch.Tensor | None, bits: int) -> None:
    """The C++ hook's result: ``None`` when every rank's row is this one (and OK), else the all-reduced table."""
    if table is None:
        agreed()
    else:
        verify(decode_table(table.tolist(), bits, world))
