"""Griffe extensions for the docs build (mkdocs.yml loads them).

- ``SphinxRoles``: docstrings written for ``help()`` use Sphinx roles (``:class:`X```); the site shows each as a link
  (an mkdocs-autorefs cross-reference), so a reference to a name that does not exist fails the strict build instead
  of printing as text.
- ``InheritedConstructors``: a dpfast class whose constructor is torch's (``SyncBatchNorm`` is a ``_BatchNorm``)
  documents that constructor's parameters; Griffe reads dpfast's source only, so it is given the signature the
  class has at run time, and its ``Args:`` are checked against it like any other.
- ``PublicBases``: a class page lists public bases only, never a private mixin of dpfast.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):`(~?)([\w.]+)`")


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda m: _link(obj, m[1] == "~", m[2]), obj.docstring.value)


def _link(obj: griffe.Object, short: bool, target: str) -> str:
    text = target.rsplit(".", 1)[-1] if short else target
    path = _resolve(obj, target)
    if path is None:  # torch's and other libraries' names: no inventory of theirs is read (the build is offline)
        return f"`{text}`"
    return f"[`{text}`][{path}]"


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """``target`` as a full dpfast path: as written when it starts with ``dpfast``, else looked up as Python would
    from ``obj`` outwards (its members, its class's, its module's); None for a name from outside dpfast."""
    head = target.split(".", 1)[0]
    if head == "dpfast":
        return target
    scope: griffe.Object | None = obj
    while scope is not None:
        if head in scope.members:
            member = scope.members[head]
            if member.is_alias and not str(member.target_path).startswith("dpfast"):
                return None
            return f"{scope.path}.{target}"
        scope = scope.parent
    if "." in target:
        return None  # a dotted name that is not dpfast's (torch.utils.data.Subset)
    return target  # unresolved: autorefs reports it, and the strict build fails


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
    inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
    inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
    inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
}


def _parameter(p: inspect.Parameter) -> griffe.Parameter:
    empty = inspect.Parameter.empty
    return griffe.Parameter(
        p.name,
        kind=_KINDS[p.kind],
        annotation=None if p.annotation is empty else inspect.formatannotation(p.annotation),
        default=None if p.default is empty else repr(p.default),
    )


class InheritedConstructors(griffe.Extension):
    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if "__init__" in cls.members or not cls.path.startswith("dpfast."):
            return
        module, _, name = cls.path.rpartition(".")
        runtime = getattr(importlib.import_module(module), name, None)
        init = getattr(runtime, "__init__", None)
        if init is None or getattr(init, "__module__", "").startswith("dpfast") or init is object.__init__:
            return
        try:
            signature = inspect.signature(init)
        except (TypeError, ValueError):
            return
        params = griffe.Parameters(*(_parameter(p) for p in signature.parameters.values()))
        cls.set_member("__init__", griffe.Function("__init__", parameters=params, parent=cls))


# The modules whose names are dpfast's public API (DESIGN.md); any other dpfast class is private, wherever it lives.
PUBLIC_MODULES = (
    "dpfast",
    "dpfast.ops",
    "dpfast.nn",
    "dpfast.reference",
    "dpfast.distributed",
    "dpfast.integrations.transformers",
)


def _public_names() -> set[str]:
    names: set[str] = set()
    for module in PUBLIC_MODULES:
        names.update(getattr(importlib.import_module(module), "__all__", ()))
    return names


class PublicBases(griffe.Extension):
    """A public class's page lists its public bases only (``dpfast.DataParallel``: ``torch.nn.DataParallel``, not
    the private mixin that holds its settings' attributes). Run once the package is loaded, when what a class
    inherits can be resolved: a constructor a private base gives (``dpfast.nn``'s ``state_batch_first``) is kept."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path == "dpfast":
            public = _public_names()
            for cls in _classes(pkg):
                _drop_private_bases(cls, public)


def _classes(obj: griffe.Object) -> list[griffe.Class]:
    found = []
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.is_class:
            found.append(member)
        if member.is_module or member.is_class:
            found.extend(_classes(member))
    return found


def _drop_private_bases(cls: griffe.Class, public: set[str]) -> None:
    kept = [b for b in cls.bases if not _is_private(str(getattr(b, "canonical_path", b)), public)]
    if len(kept) == len(cls.bases):
        return
    if "__init__" not in cls.members:
        init = cls.inherited_members.get("__init__")
        if init is not None:
            cls.set_member("__init__", init)
    cls.bases = kept


def _is_private(path: str, public: set[str]) -> bool:
    """A dpfast class that is not public API (torch's own bases are shown as torch names them)."""
    return path.startswith("dpfast.") and path.rsplit(".", 1)[-1] not in public
