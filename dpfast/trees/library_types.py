"""Containers that other libraries define, for :mod:`dpfast.trees.flatten`: types registered with
``torch.utils._pytree`` (``collections.deque``, HF's ``ModelOutput`` classes, anything a user registers), walked
through their registered flatten/unflatten; and transformers' KV caches (``Cache`` and its layers), which
transformers does not register unless asked to (for ``torch.export``), walked through their attributes.

Nothing here imports transformers: a Cache can only be passed in once transformers is imported, so its classes are
looked up in ``sys.modules``.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
import torch.utils._pytree as _pytree
from torch import Tensor

# ---- torch.utils._pytree registrations ---------------------------------------------------------------------------


class PytreeMeta:
    """A registered node's type, registration and context (what its unflatten needs besides the children)."""

    __slots__ = ("type", "node", "context")

    def __init__(self, typ: type, node: Any, context: Any):
        self.type, self.node, self.context = typ, node, context


def pytree_node(obj: Any) -> Any:
    """The ``torch.utils._pytree`` registration of ``type(obj)``, or None."""
    return _pytree.SUPPORTED_NODES.get(type(obj))


def pytree_children(obj: Any) -> tuple[tuple, tuple, PytreeMeta]:
    """``(keys, values, meta)``: keys are the registration's key entries (``.name``, ``['key']``, ``[0]``) when it
    has ``flatten_with_keys``, else positions."""
    node = pytree_node(obj)
    values, context = node.flatten_fn(obj)
    keys: tuple = tuple(range(len(values)))
    if node.flatten_with_keys_fn is not None:
        pairs, _ = node.flatten_with_keys_fn(obj)
        if len(pairs) == len(values):
            keys = tuple(k for k, _ in pairs)
    return keys, tuple(values), PytreeMeta(type(obj), node, context)


def key_name(key: Any) -> Any:
    """What a dict spec names a pytree child by: a mapping key, an attribute name, or a position."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr) and not isinstance(key, (int, str)):
            return getattr(key, attr)
    return key


def pytree_rebuild(meta: PytreeMeta, values: list) -> Any:
    return meta.node.unflatten_fn(values, meta.context)


# ---- transformers' KV caches -------------------------------------------------------------------------------------

_CACHE_BASES = ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin")
_cache_types: tuple[Any, tuple] = (None, ())


def _cache_classes() -> tuple:
    global _cache_types
    mod = sys.modules.get("transformers.cache_utils")
    if mod is None:
        return ()
    if _cache_types[0] is not mod:
        _cache_types = (mod, tuple(t for t in (getattr(mod, n, None) for n in _CACHE_BASES) if isinstance(t, type)))
    return _cache_types[1]


def is_cache(obj: Any) -> bool:
    """A transformers Cache or cache layer (the per-layer objects holding the key/value tensors)."""
    classes = _cache_classes()
    return bool(classes) and isinstance(obj, classes)


def _is_state(v: Any) -> bool:
    """Attributes that are a cache's batch state: tensors with a batch axis, nested caches and layers, and lists
    and dicts of them. Scalars, flags, configs and 0-dim tensors (a sliding window's size) are bookkeeping, copied
    as they are."""
    if isinstance(v, Tensor):
        return v.dim() > 0
    if isinstance(v, (list, tuple)):
        return any(_is_state(x) for x in v)
    if isinstance(v, dict):  # a linear-attention layer's conv/recurrent states, by layer index
        return any(_is_state(x) for x in v.values())
    return is_cache(v)


def cache_children(obj: Any) -> tuple[tuple, tuple]:
    items = [(k, v) for k, v in vars(obj).items() if _is_state(v)]
    return tuple(k for k, _ in items), tuple(v for _, v in items)


def cache_rebuild(orig: Any, keys: tuple, values: list) -> Any:
    """A shallow copy of ``orig`` holding ``values``: a replica's own cache, which its model updates in place.
    Mutable bookkeeping (the list a cache grows its layers into, a dict of flags, the 0-dim counters a StaticCache
    layer increments in place) is copied too, so replicas never write into one shared object, nor into the
    caller's; ``device`` and 0-dim tensors follow the new tensors' device."""
    new = copy.copy(orig)
    state = vars(new)
    for k, v in state.items():
        if k not in keys and isinstance(v, (list, dict, set)):
            state[k] = copy.copy(v)
    state.update(zip(keys, values))
    device = next((v.device for v in values if isinstance(v, Tensor)), None)
    if device is not None and isinstance(state.get("device"), torch.device):
        state["device"] = device
    for k, v in state.items():
        if isinstance(v, Tensor) and v.dim() == 0 and k not in keys:
            state[k] = v.to(device) if device is not None and v.device != device else v.clone()
    return new
