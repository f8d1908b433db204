"""The exceptions dpfast raises for a call it cannot plan (their messages are worded by :mod:`dpfast.plan.render`)."""

from __future__ import annotations


class ScatterError(ValueError):
    """Raised before anything is copied when a call's inputs cannot be split into one batch (a ``ValueError``).

    The tensors mapped to a batch axis disagree on ``B`` (or one has no such axis): the message is a table of every
    mapped tensor (its path, shape, spec, axis and size), marks the culprits and suggests an ``in_dims`` (an axis
    that has size ``B``, ``None`` when none has, ``"items"`` for a list of per-sample tensors).
    """

    __module__ = "dpfast"  # printed and pickled as dpfast.ScatterError, the name users catch it by
