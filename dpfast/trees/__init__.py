"""Stage 1, trees: values to leaves and specs. Flattening argument and output trees (every container kind, torch
pytree nodes, HF KV caches), ``in_dims``/``out_dims`` specs matched to them, and ``in_dims`` bound to ``forward``'s
signature.

Nothing here looks at batch sizes or devices: that is planning's.
"""
