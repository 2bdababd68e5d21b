"""What a user's step means across replicas.

An output's reduction (``_outputs``, ``_outputs_walk``), a summed loss
(``_summed_loss``, reading the jaxpr with ``_jaxpr_scope``), a metric's global
update (``_metrics``), per-replica randomness (``_random``, ``_random_guards``),
per-example gradients (``_per_example``), operations that mix the batch's rows
(``_row_mixing``), ``fleet.all_gather``'s gradient (``_gathered``) and the errors
JAX raises while tracing a step, said in fleet's words (``_trace_errors``).
Builds on ``fleet.comm`` and ``fleet.runtime``.
"""
