"""The turn-taking of replicas (dpfast.run.rendezvous.Call), driven directly with stand-in devices: replicas of one
device never run at the same time and take turns in a fixed order, every device runs concurrently, collectives
complete with every replica's deposit, and a replica that fails or skips a collective never leaves another
waiting."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpfast.run.rendezvous import Call, CollectiveError


def _run_call(devices, behaviour, timeout=30):
    """Run a Call whose replica ``i`` does ``behaviour[i]``: a list of steps, each "c" (a collective, depositing
    its index) or "raise" / "return" (leave). Returns (trace, errors, results)."""
    n = len(devices)
    trace: list[tuple] = []
    running: dict = {}
    lock = threading.Lock()
    results: list = [None] * n
    errors: list = [None] * n
    threads: list[threading.Thread] = []

    def note(i, what):
        with lock:
            trace.append((i, what))
            d = devices[i]
            if what == "start":
                assert running.get(d) is None, f"replica {i} runs while {running.get(d)} of its device does"
                running[d] = i
            elif what == "stop":
                assert running.get(d) == i
                running[d] = None

    call_box = {}

    def run(i):
        call = call_box["call"]
        note(i, "start")
        try:
            got = []
            for step in behaviour[i]:
                if step == "raise":
                    raise ValueError(f"replica {i} fails")
                if step == "return":
                    break
                note(i, "stop")
                try:
                    coll = call.enter(i, ("all_reduce", "sum"), i)
                finally:  # it returns (or raises) once it has its device's turn again
                    note(i, "start")
                got.append(sorted(coll.values.values()))
            results[i] = got
        except BaseException as exc:  # noqa: BLE001 - recorded
            errors[i] = exc
        finally:
            note(i, "stop")
        return errors[i]

    def spawn(fn, device):
        t = threading.Thread(target=fn, daemon=True)
        threads.append(t)
        t.start()

    call = call_box["call"] = Call(devices, run, spawn)
    main = threading.Thread(target=call.run_all, daemon=True)
    main.start()
    main.join(timeout)
    assert not main.is_alive(), f"the call hung; trace so far {trace}"
    for t in list(threads):
        t.join(timeout)
        assert not t.is_alive()
    return trace, errors, results


def test_one_device_takes_turns_in_index_order():
    trace, errors, results = _run_call(["d"] * 3, [["c", "c"]] * 3)
    assert errors == [None] * 3 and results == [[[0, 1, 2]] * 2] * 3
    starts = [i for i, what in trace if what == "start"]
    assert starts == [0, 1, 2, 0, 1, 2, 0, 1, 2]  # each resumes in index order after every collective


def test_no_collective_runs_inline_one_after_another():
    trace, errors, _ = _run_call(["d"] * 4, [[]] * 4)
    assert errors == [None] * 4 and [i for i, w in trace if w == "start"] == [0, 1, 2, 3]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    groups=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    n_collectives=st.integers(0, 3),
    data=st.data(),
)
def test_any_pattern_completes_or_fails_cleanly(groups, n_collectives, data):
    devices = [f"dev{g}" for g, size in enumerate(groups) for _ in range(size)]
    n = len(devices)
    behaviour = [["c"] * n_collectives for _ in range(n)]
    # some replicas leave early: raise or return after k collectives
    leavers = data.draw(st.lists(st.integers(0, n - 1), max_size=2, unique=True))
    for i in leavers:
        k = data.draw(st.integers(0, n_collectives))
        behaviour[i] = ["c"] * k + [data.draw(st.sampled_from(["raise", "return"]))]
    _, errors, results = _run_call(devices, behaviour)
    counts = [b.count("c") for b in behaviour]
    raises = any(b[-1:] == ["raise"] for b in behaviour)
    if not raises and len(set(counts)) == 1:  # every replica calls the same collectives: all complete
        assert errors == [None] * n and all(r == [list(range(n))] * counts[0] for r in results)
        return
    for i in range(n):
        # a replica meant to raise later may first meet a collective another one left behind
        allowed = (ValueError, CollectiveError) if behaviour[i][-1:] == ["raise"] else CollectiveError
        assert errors[i] is None or isinstance(errors[i], allowed), errors[i]
    assert any(errors), "the replicas called different collectives, but nothing failed"
    # every completed collective saw every replica's deposit
    assert all(got == list(range(n)) for r in results if r for got in r)


@pytest.mark.parametrize("n", [2, 5])
def test_the_first_device_runs_in_the_calling_thread(n):
    seen = []

    def run(i):
        seen.append(threading.current_thread())
        return None

    Call(["d"] * n, run, lambda fn, device: pytest.fail("no thread is needed")).run_all()
    assert seen == [threading.current_thread()] * n
