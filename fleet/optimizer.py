"""Paddle's ``paddle.optimizer`` names for the optimizers the strategy can swap.

``fleet.optimizer.Momentum`` and ``fleet.optimizer.Adam`` are ``optax.sgd`` and
``optax.adam``, tagged with their hyper-parameters, so that ``strategy.lars``
and ``strategy.lamb`` can rebuild them as ``optax.lars`` / ``optax.lamb`` with
the same learning rate (an optax transformation cannot be read back).

Example:
    >>> tx = fleet.optimizer.Momentum(learning_rate=0.1, momentum=0.9)  # doctest: +SKIP
    >>> optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
"""

from fleet.sections._hparams import Adam, Momentum

__all__ = ["Adam", "Momentum"]
