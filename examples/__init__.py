"""The seed models under dpfast: ``rrn.py`` (seed 000), ``transformer.py`` (seed 004), ``rrn_fused_state.py``.

Each file runs on its own (``python examples/rrn.py``) and is importable (model classes and ``main(argv=None)``);
``python -m dpfast demo`` runs them all.
"""
