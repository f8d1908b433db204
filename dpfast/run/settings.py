"""A DataParallel's settings, resolved: its public attributes (``device_ids``, ``output_device``, ``dim``,
``in_dims``, ``out_dims``, ``chunk_sizes``, ``cost``) checked and turned into what a call runs with (devices,
weights, ``in_dims`` bound to the module's ``forward``, the cost reader).

torch's DataParallel reads ``self.device_ids``, ``self.dim`` and ``self.output_device`` at every call, so whatever
a user assigns (or changes in place, ``dp.device_ids.pop()``) is what the next call runs with. Here too: a
:class:`Settings` remembers a *fingerprint* of the values it was resolved from (and of the module and its
``forward``, whose signature ``in_dims`` names bind to), and the wrapper resolves anew at a call whose values no
longer match it (the very same values, each container among them flat and holding the very same atoms, match
without computing the fingerprint; a nested spec is always fingerprinted). An assignment is checked at once (an
invalid value is refused and nothing changes).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from ..ext.op_checks import DeviceLike
from ..plan.costs import CostSource
from ..plan.program import ProgramCache
from ..plan.splits import validate_chunk_sizes
from ..trees.binding import Binding, forward_of
from ..trees.specs import validate_spec

NAMES = ("device_ids", "output_device", "dim", "in_dims", "out_dims", "chunk_sizes", "cost")
_ATOMS = (int, float, str, bytes, type(None), torch.device)


def resolve_device(d: DeviceLike, what: str) -> torch.device:
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


def public_device(dev: torch.device) -> int | torch.device:
    """How torch.nn.DataParallel exposes a device: its index for CUDA (we keep torch.device('cpu') for the CPU)."""
    return dev.index if dev.type == "cuda" else dev


def _resolve_devices(device_ids: Any) -> list[torch.device]:
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
    devices = [resolve_device(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
    if len({d.type for d in devices}) > 1:
        raise ValueError(
            f"device_ids mix device types ({', '.join(map(str, devices))}); use all CUDA devices, or 'cpu' "
            "repeated for a CPU rehearsal"
        )
    return devices


def check_given_device_ids(device_ids: Any) -> None:
    """``device_ids`` a user gives (to the constructor or by assignment): None, or a non-empty sequence (an empty
    list is how the wrapper itself says "call the module directly")."""
    try:
        empty = device_ids is not None and len(device_ids) == 0
    except TypeError:
        return  # not a sequence: resolving it says why
    if empty:
        raise ValueError(
            f"device_ids must be a non-empty sequence of devices (e.g. [0, 1] or ['cpu'] * 2), got {device_ids!r}"
        )


def fingerprint(value: Any) -> Any:
    """A comparable copy of a setting's value: containers by content (so changes made in place show), other
    objects (callables, dataclass specs, arrays) by identity."""
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(fingerprint(v) for v in value))
    if isinstance(value, Mapping):
        return (type(value), tuple((k, fingerprint(v)) for k, v in value.items()))
    return ("object", id(value))


class Settings:
    """What a call runs with. ``devices`` is empty when the module is called directly (no CUDA and no
    ``device_ids``, as torch does)."""

    def __init__(self, module: nn.Module, values: Mapping[str, Any]):
        values = {name: values[name] for name in NAMES}
        self.specs = Binding(forward_of(module), values["in_dims"], values["dim"])
        validate_spec(values["out_dims"], "out_dims", allow_reductions=True)
        cost = values["cost"]
        self.cost = None if cost is None else CostSource(cost, self.specs)
        self.devices, self.output_device, self.weights = self._devices(values)
        # the public attributes as the wrapper exposes them: devices as torch does (CUDA indices)
        values["device_ids"] = [public_device(d) for d in self.devices]
        values["output_device"] = None if self.output_device is None else public_device(self.output_device)
        self.values = values
        # the gather programs of outputs under these out_dims and dim (a change of either makes new settings, and
        # with them new programs)
        self.outputs = ProgramCache()
        self._module, self._forward = module, _forward_identity(module)
        self._seen = tuple(values.values())
        self._fingerprint = fingerprint(self._seen)
        self._out_dims = fingerprint(values["out_dims"])
        self._shallow = _flat_containers(self._seen)
        # out_dims as a flat container of atoms (even beside a nested in_dims): checked by identity at each gather
        self._out_flat = next(iter(_flat_containers((values["out_dims"],)) or ()), None)

    def outputs_for(self, out_dims: Any) -> ProgramCache | None:
        """:attr:`outputs`, when ``out_dims`` (the wrapper's at the gather) is still the one these settings were
        resolved from: a ``forward`` may change it in place, and the gather then walks it as a fresh wrapper does."""
        flat = self._out_flat
        unchanged = out_dims is self.values["out_dims"] and (
            isinstance(out_dims, _ATOMS)
            or (flat is not None and type(out_dims) is flat[1] and _same_atoms(out_dims, flat[2], flat[3]))
            or fingerprint(out_dims) == self._out_dims
        )
        return self.outputs if unchanged else None

    @staticmethod
    def _devices(values: Mapping[str, Any]) -> tuple[list[torch.device], torch.device | None, list[Fraction] | None]:
        device_ids, output_device, chunk_sizes = values["device_ids"], values["output_device"], values["chunk_sizes"]
        if device_ids is None and torch.cuda.is_available():
            device_ids = list(range(torch.cuda.device_count()))
        if device_ids is None or (isinstance(device_ids, list) and not device_ids and output_device is None):
            # like torch: no accelerator and nothing asked for -> call the module directly. output_device and the
            # number of chunk_sizes are ignored then (code written for N GPUs still runs), their types are not.
            if chunk_sizes is not None:
                validate_chunk_sizes(chunk_sizes, len(chunk_sizes) if hasattr(chunk_sizes, "__len__") else 0)
            return [], None, None
        devices = _resolve_devices(device_ids)
        out = devices[0] if output_device is None else resolve_device(output_device, "output_device")
        return devices, out, validate_chunk_sizes(chunk_sizes, len(devices))

    def matches(self, module: nn.Module, values: Mapping[str, Any]) -> bool:
        """Whether ``values`` (the wrapper's attributes now, in :data:`NAMES` order) and ``module`` are still the
        ones these settings were resolved from."""
        if module is not self._module or not all(map(operator.is_, _forward_identity(module), self._forward)):
            return False
        now = tuple(values.values())
        if self._shallow is not None and all(map(operator.is_, now, self._seen)):
            # the very same values: only a container's contents can have changed, and each holds atoms only
            shallow = self._shallow
            if all(type(now[i]) is kind and _same_atoms(now[i], m, atoms) for i, kind, m, atoms in shallow):
                return True
        return fingerprint(now) == self._fingerprint


def _atoms_of(value: list | tuple | Mapping, mapping: bool) -> list:
    return [*value, *value.values()] if mapping else list(value)  # type: ignore[union-attr]


def _same_atoms(value: list | tuple | Mapping, mapping: bool, atoms: list) -> bool:
    items = _atoms_of(value, mapping)
    return len(items) == len(atoms) and all(map(operator.is_, items, atoms))


def _flat_containers(values: tuple) -> list[tuple[int, type, bool, list]] | None:
    """What :meth:`Settings.matches` checks by identity, beside the values themselves, before it compares
    fingerprints: for each container among ``values`` its index, type, whether it is a mapping, and the atoms it
    holds (a mapping's keys and values). None when a container holds another container or an object: its contents
    can change without its atoms changing, so only the fingerprint tells."""
    shallow = []
    for i, v in enumerate(values):
        if isinstance(v, (list, tuple, Mapping)):
            mapping = isinstance(v, Mapping)
            atoms = _atoms_of(v, mapping)
            if not all(isinstance(a, _ATOMS) for a in atoms):
                return None
            shallow.append((i, type(v), mapping, atoms))
    return shallow


def _forward_identity(module: nn.Module) -> tuple:
    """The forward whose signature ``in_dims`` binds to, by its function and owner (a bound method is a new
    object at every attribute read)."""
    forward = forward_of(module)
    return getattr(forward, "__func__", forward), getattr(forward, "__self__", None)
