"""The wrapper's public attributes (``device_ids``, ``dim``, ``in_dims``, ...), as ``DataParallel`` keeps them: an
assignment is checked at once (an invalid value is refused and nothing changes), a value changed in place is
resolved again at the next call, and a pickle holds the attributes only, never what derives from them.

:class:`SettingsAttributes` is a mixin of ``dpfast.DataParallel``; it expects ``self.module`` and ``self._pool``.
"""

from __future__ import annotations

from typing import Any

from .replicas import ReplicaCache
from .settings import NAMES, Settings, check_given_device_ids
from .workers import WorkerPool

# What a DataParallel derives from its public attributes, never pickled (the first layout pickled these too).
_DERIVED = frozenset({"_settings", "_replicas", "_pool", "_specs", "_cost", "_devices", "_output_device", "_weights"})


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class SettingsAttributes:
    """The settings as public attributes, read at every call (a mixin of ``DataParallel``)."""

    module: Any
    _pool: WorkerPool

    def __setattr__(self, name: str, value: Any) -> None:
        """``dp.dim = 1``, ``dp.device_ids = [...]``, ...: checked now (an invalid value is refused and nothing
        changes), and what the next call runs with."""
        if name in NAMES and "_settings" in self.__dict__:
            values = {**self._current_values(), name: value}
            try:
                if name == "device_ids":
                    check_given_device_ids(value)
                settings = Settings(self.module, values)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"DataParallel.{name} = {_short(value)} refused (nothing changed): {exc}") from None
            self._use(settings)
            return
        super().__setattr__(name, value)

    def _current_values(self) -> dict[str, Any]:
        d = self.__dict__
        return {name: d.get(name) for name in NAMES}

    def _use(self, settings: Settings) -> None:
        d = self.__dict__
        d.update(settings.values)
        d["_settings"] = settings
        d["src_device_obj"] = settings.devices[0] if settings.devices else None
        self._pool.max_idle = max(len(settings.devices) - 1, 0)

    def _current_settings(self) -> Settings:
        """The settings for this call: resolved again when an attribute was changed in place since the last."""
        settings = self.__dict__.get("_settings")
        values = self._current_values()
        if settings is None or not settings.matches(self.module, values):
            settings = Settings(self.module, values)
            self._use(settings)
        return settings

    # what a call runs with (read through these by the call path, after _current_settings())
    _devices = property(lambda self: self._settings_or_now().devices)
    _output_device = property(lambda self: self._settings_or_now().output_device)
    _weights = property(lambda self: self._settings_or_now().weights)
    _specs = property(lambda self: self._settings_or_now().specs)
    _cost = property(lambda self: self._settings_or_now().cost)

    def _settings_or_now(self) -> Settings:
        settings = self.__dict__.get("_settings")
        return settings if settings is not None else self._current_settings()

    def __getstate__(self) -> dict:
        """The module and the public attributes only: what a call derives from them is derived again on load."""
        return {k: v for k, v in self.__dict__.items() if k not in _DERIVED}

    def __setstate__(self, state: dict) -> None:
        """New pickles, and those of the first layout (which also held ``_specs``, ``_cost``, ``_devices``...)."""
        state = {k: v for k, v in state.items() if k not in _DERIVED}
        super().__setstate__(state)
        d = self.__dict__
        d["_replicas"] = ReplicaCache()
        d["_pool"] = WorkerPool(max_idle=max(len(d.get("device_ids") or ()) - 1, 0))
        d["_settings"] = None  # resolved at the first call (a pickle from a GPU machine still loads on a CPU one)
