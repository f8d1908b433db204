"""Stage 4, running: replicas that behave like separate devices, the worker threads they run on, their turns on a
shared device and the collectives they meet at (``dpfast.all_gather``, ``dpfast.nn.SyncBatchNorm``), and executing a
call's replicas.
"""
