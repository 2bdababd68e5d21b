"""What a user's step means across replicas.

An output's reduction (``_outputs``, ``_outputs_walk``), a metric's global update
(``_metrics``), per-replica randomness (``_random``, ``_random_guards``) and the
errors JAX raises while tracing a step, said in fleet's words
(``_trace_errors``). Builds on ``fleet.comm`` and ``fleet.runtime``.
"""
