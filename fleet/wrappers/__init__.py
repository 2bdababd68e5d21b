"""Paddle's step 3: ``fleet.distributed_model`` and ``fleet.distributed_optimizer``.

:class:`DataParallel` (and its Linen form, ``_data_parallel``) owns gradient
synchronisation; :class:`DistributedOptimizer` (``_distributed_optimizer``) owns
the optimizer's sections, with its optax transformation in ``_distributed_tx`` and
gradient merge (and the ``no_sync`` accumulator) in ``_gradient_merge``. Builds on
``fleet.sections``.
"""
