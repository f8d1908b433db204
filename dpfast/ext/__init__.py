"""Stage 0, the extension: loading ``dpfast._C`` (or the plain-PyTorch fallback), the torch features older releases
lack, and the fused ops' argument checks shared by :mod:`dpfast.ops`, :mod:`dpfast.reference` and the fake kernels.

Every later stage may import it; it imports no other part of dpfast.
"""
