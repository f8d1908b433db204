"""The module paths of dpfast's earlier layouts (``dpfast._binding``, ``dpfast._replicas``, ...,
``dpfast.distributed.sharding``), importable as aliases of the modules that hold their code now, so that an object
saved whole with ``torch.save`` by them (its pickle names classes by module path) still loads. Nothing in dpfast
imports these names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

# old module -> the module that holds its code now
MOVED = {
    "dpfast._extension": "dpfast.ext.loader",
    "dpfast._compat": "dpfast.ext.torch_compat",
    "dpfast._op_checks": "dpfast.ext.op_checks",
    "dpfast._nodes": "dpfast.trees.library_types",
    "dpfast._tree": "dpfast.trees.flatten",
    "dpfast._specs": "dpfast.trees.specs",
    "dpfast._binding": "dpfast.trees.binding",
    "dpfast._nested": "dpfast.move.nested",
    "dpfast._splits": "dpfast.plan.splits",
    "dpfast._costs": "dpfast.plan.costs",
    "dpfast._render": "dpfast.plan.render",
    "dpfast._errors": "dpfast.plan.errors",
    "dpfast._planning": "dpfast.plan.call_plan",
    "dpfast._transfer": "dpfast.move.scatter",
    "dpfast._gather": "dpfast.move.gather",
    "dpfast._broadcast": "dpfast.move.broadcast",
    "dpfast._replicas": "dpfast.run.replicas",
    "dpfast._workers": "dpfast.run.workers",
    "dpfast._rendezvous": "dpfast.run.rendezvous",
    "dpfast._collectives": "dpfast.run.collectives",
    "dpfast._execute": "dpfast.run.execute",
    "dpfast._sync_batchnorm": "dpfast.run.sync_batchnorm",
    "dpfast.distributed.collectives": "dpfast.distributed.group",
    # the distributed modules regrouped since: a pickled Share (dpfast.distributed.Share) names its old module
    "dpfast.distributed.sharding": "dpfast.distributed.inputs",
    "dpfast.distributed.exchanges": "dpfast.distributed.group",
}
# classes renamed since: old module -> {old class name: its name now}
RENAMED = {
    "dpfast._binding": {"ArgumentSpecs": "Binding"},
    "dpfast._costs": {"CostSpec": "CostSource"},
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as the very module object of its new path (so classes are identical), or, where classes
    were renamed, as a module that reads the new one's attributes under the old names too."""

    def find_spec(self, name: str, path=None, target=None):  # noqa: ANN001 - importlib's signature
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec) -> ModuleType:  # noqa: ANN001
        target = importlib.import_module(MOVED[spec.name])
        renamed = RENAMED.get(spec.name)
        if renamed is None:
            return target
        alias = ModuleType(spec.name, target.__doc__)
        alias.__getattr__ = lambda name: getattr(target, renamed.get(name, name))  # type: ignore[method-assign]
        return alias

    def exec_module(self, module: ModuleType) -> None:
        pass


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
