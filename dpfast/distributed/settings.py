"""The wrapper's own settings, which every rank must share.

They decide which collectives a step runs (``gather_outputs``, ``check_batch``), how a batch is cut (``inputs``,
``in_dims``, ``dim``, ``chunk_sizes``, ``cost``) and how outputs are combined (``out_dims``), so ranks that differ
would wait in different collectives. The constructor compares them across the ranks once, before torch's DDP
broadcasts anything (a rank whose settings are invalid takes part too, so the others do not wait for it), and they
are fixed afterwards: assigning one raises.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from torch import nn

from ..plan.costs import CostSource
from ..trees.binding import Binding, forward_of
from ..trees.specs import validate_spec
from .disagreement import NAME, DistributedBatchError
from .group import rank_weights

FIXED = ("inputs", "in_dims", "out_dims", "dim", "chunk_sizes", "cost", "gather_outputs", "check_batch")
INPUTS = ("global", "per_rank")
# torch DDP's parameters after (module, device_ids, output_device, dim), in its order: they may come by position
_TORCH_AFTER_DIM = tuple(inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters)[5:]


def torch_ddp_kwargs(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """torch DDP's arguments after ``dim``, given by position as its constructor takes them, by name."""
    if len(args) > len(_TORCH_AFTER_DIM):
        raise TypeError(
            f"{NAME} takes at most {4 + len(_TORCH_AFTER_DIM)} positional arguments after the module, as torch's "
            f"DistributedDataParallel does ({4 + len(args)} were given); pass dpfast's own settings (inputs, "
            "in_dims, out_dims, ...) by name"
        )
    named = dict(zip(_TORCH_AFTER_DIM, args))
    twice = sorted(named.keys() & kwargs.keys())
    if twice:
        raise TypeError(f"{NAME} got two values for {twice[0]!r}: pass it by position or by name, not both")
    return {**named, **kwargs}


def _text(value: Any) -> str:
    if callable(value) and not isinstance(value, type):
        module = getattr(value, "__module__", None) or ""
        name = getattr(value, "__qualname__", None) or type(value).__name__
        return f"<function {module}.{name}>"
    return repr(value)


def describe_settings(values: dict[str, Any], forward_text: str) -> dict[str, str]:
    """The settings as the ranks compare them (a callable ``cost`` by its qualified name)."""
    out = {name: _text(values[name]) for name in FIXED}
    out["forward"] = forward_text
    return out


def check_inputs_mode(inputs: Any, chunk_sizes: Any, cost: Any, check_batch: Any) -> None:
    """The settings that per-rank inputs exclude: they shape a split of a global batch, which has none."""
    if inputs not in INPUTS:
        raise ValueError(
            f"inputs must be 'global' (every rank gets the global batch and keeps its rows) or 'per_rank' (every "
            f"rank passes only its own rows), got {inputs!r}"
        )
    if inputs == "per_rank":
        for name, value in (("chunk_sizes", chunk_sizes), ("cost", cost)):
            if value is not None:
                raise ValueError(
                    f"{name} weights the split of a global batch, and inputs='per_rank' has none (each rank passes "
                    "its own rows): drop it, and balance the ranks' shares where they are loaded (e.g. "
                    "dpfast.distributed.BalancedBatchSampler balances cost)"
                )
        if check_batch == "values":
            raise ValueError(
                "check_batch='values' compares the ranks' copies of the global batch; with inputs='per_rank' every "
                "rank has its own rows: use check_batch=True"
            )


def check_settings(module: Any, values: dict[str, Any], process_group: Any, name: str = NAME) -> tuple:
    """This rank's settings checked (raises TypeError/ValueError naming the argument): the specs bound to
    ``module.forward`` (whose suggested fixes name the wrapper, ``name``), the cost spec, and the ranks' weights
    (when the process group is known)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if values["check_batch"] not in (True, False, "values"):
        raise ValueError(f"check_batch must be True, False or 'values', got {values['check_batch']!r}")
    check_inputs_mode(values["inputs"], values["chunk_sizes"], values["cost"], values["check_batch"])
    specs = Binding(forward_of(module), values["in_dims"], values["dim"], name)
    validate_spec(values["out_dims"], "out_dims", allow_reductions=True)
    cost_spec = None if values["cost"] is None else CostSource(values["cost"], specs)
    weights = None
    if dist.is_available() and dist.is_initialized():
        weights = rank_weights(values["chunk_sizes"], dist.get_world_size(process_group))
    return specs, cost_spec, weights


def agreed_settings(
    module: Any, values: dict[str, Any], process_group: Any, name: str = NAME, also: Callable[[], None] | None = None
) -> tuple:
    """:func:`check_settings` on this rank (and ``also``, a check of the wrapper's own), then
    :func:`agree_on_settings`: the checked settings once every rank built the same valid ones. A rank whose
    settings are invalid still takes part, so that the others do not wait for it."""
    try:
        if also is not None:
            also()
        checked = check_settings(module, values, process_group, name)
    except (TypeError, ValueError) as exc:
        agree_on_settings(process_group, None, exc, name)
        raise
    agree_on_settings(process_group, describe_settings(values, checked[0].signature_text), None, name)
    return checked


def agree_on_settings(
    process_group: Any, settings: dict[str, str] | None, error: BaseException | None, name: str = NAME
) -> None:
    """Return when every rank of ``process_group`` built the same valid settings; else raise on every rank: the
    error itself when every rank hit the same one, else :class:`DistributedBatchError` saying, per rank, what
    differs (or which ranks' settings are invalid)."""
    world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
    mine = (settings, None if error is None else f"{type(error).__name__}: {error}")
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=process_group)
    failed = [r for r, (_, err) in enumerate(everyone) if err is not None]
    if failed:
        if error is not None and len(failed) == world and len({err for _, err in everyone}) == 1:
            raise error  # the same mistake everywhere: no disagreement to report
        lines = [f"{name}: the settings of rank{'s' if len(failed) > 1 else ''} {_ranks(failed)} are invalid"]
        lines += [f"  rank {r}{_me(r, rank)}: {err or 'valid'}" for r, (_, err) in enumerate(everyone)]
        raise DistributedBatchError("\n".join(lines)) from error
    differ = [k for k in settings or {} if len({s[k] for s, _ in everyone}) > 1]
    if not differ:
        return
    lines = [
        f"{name}: the ranks were built with different settings ({', '.join(differ)}); every rank must construct "
        "it with the same ones"
    ]
    lines += [
        f"  rank {r}{_me(r, rank)}: " + ", ".join(f"{k}={s[k]}" for k in differ) for r, (s, _) in enumerate(everyone)
    ]
    raise DistributedBatchError("\n".join(lines))


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _me(r: int, rank: int) -> str:
    return " (this rank)" if r == rank else ""
