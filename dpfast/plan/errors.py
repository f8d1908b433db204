"""The exceptions dpfast raises for a call it cannot plan (their messages are worded by :mod:`dpfast.plan.render`)."""

from __future__ import annotations


class ScatterError(ValueError):
    """The inputs cannot be split into one batch: the message lists every mapped tensor and suggests a fix."""

    __module__ = "dpfast"  # printed and pickled as dpfast.ScatterError, the name users catch it by
