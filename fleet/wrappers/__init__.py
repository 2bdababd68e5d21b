"""Paddle's step 3: ``fleet.distributed_model`` and ``fleet.distributed_optimizer``.

:class:`DataParallel` (and its Linen form, ``_data_parallel``) owns gradient
synchronisation; :class:`DistributedOptimizer` (``_distributed_optimizer``) owns
the optimizer's sections. Builds on ``fleet.sections``.
"""
