"""A short seeded run of the structural fuzzer (tests/fuzz_structures.py; ``make sanitize`` runs a longer one):
random argument trees through an identity module come back exactly, or raise a dpfast error naming the argument,
the same from plan() and the call."""

from __future__ import annotations

import fuzz_structures
import pytest


@pytest.mark.parametrize("seed", [0, 10_000])
def test_a_short_seeded_run(seed):
    n, failures = fuzz_structures.run(seed, rounds=100)
    assert n == 100
    assert not failures, "\n".join(failures[:5])


def test_the_oracle_sees_a_wrong_round_trip():
    """The oracle can fail: a changed byte, a lost type, an object that is not the same one."""
    import torch

    x = torch.zeros(3)
    assert fuzz_structures.same((x,), (x,)) is None
    assert "bytes differ" in fuzz_structures.same((x + 1,), (x,))
    assert "list != tuple" in fuzz_structures.same([x], (x,))
    assert "is not" in fuzz_structures.same((fuzz_structures.Opaque(),), (fuzz_structures.Opaque(),))
    assert "set on one side only" in fuzz_structures.same(
        fuzz_structures.Unset(x), _with_later(fuzz_structures.Unset(x))
    )


def _with_later(v):
    v.later = 1
    return v
