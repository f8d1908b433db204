"""dpfast with other libraries. Each submodule imports its library when it is imported itself (never before):
``dpfast.integrations.transformers`` holds ``DataParallelTrainer``, a Hugging Face ``Trainer`` on dpfast, and
``dpfast.integrations.lightning`` holds ``DataParallelStrategy``, a Lightning Fabric strategy on dpfast.

The submodules are reachable as attributes (``dpfast.integrations.transformers``) and load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["lightning", "transformers"]

# Not imported for type checkers either: checking code that uses dpfast must not make mypy read those libraries.
# Code that uses it imports it (`from dpfast.integrations.transformers import DataParallelTrainer`).
if not TYPE_CHECKING:

    def __getattr__(name: str):
        if name not in __all__:
            raise AttributeError(f"module 'dpfast.integrations' has no attribute {name!r}")
        return importlib.import_module(f"{__name__}.{name}")  # sets the attribute on this package too
