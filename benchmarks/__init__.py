"""The benchmarks, ``bench_ops.py`` and ``bench_dp.py``: run ``python -m dpfast bench`` (installed as
``dpfast.benchmarks``), or a script directly from a checkout."""
