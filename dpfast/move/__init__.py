"""Stage 3, moving tensors: a planned call's argument tree scattered to the replicas, their outputs gathered back,
and parameters and buffers broadcast, all through :mod:`dpfast.ops`.
"""
