"""Stage 2, planning: one call's :class:`~dpfast.plan.call_plan.CallPlan` (``B``, the chunk per device or rank,
the mapped leaves), the splits it uses (even, weighted, cost-balanced), the tables it prints and the errors it raises.

Planning decides and never copies: every error about a call's arguments is raised here, before anything moves.
"""
