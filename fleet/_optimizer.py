"""``fleet.distributed_optimizer``: average the gradients over replicas, then update.

The reduction is an optax transformation placed before the user's: its state is
exactly the inner optimizer's state, so checkpoints move freely between
single-device and distributed runs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fleet import _context
from fleet._errors import FleetTypeError
from fleet._model import replicate_in_place
from fleet._reduce import reduce_gradients


class _AllReduceThen(optax.GradientTransformationExtraArgs):
    """Marks a transformation that fleet already made distributed."""


def _distributed_tx(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    if isinstance(inner, _AllReduceThen):
        return inner
    inner = optax.with_extra_args_support(inner)

    def update(grads, state, params=None, **extra):
        reduced = reduce_gradients(grads)
        if reduced is None:  # no_sync: accumulated; the optimizer does not step
            return jax.tree.map(jnp.zeros_like, grads), state
        return inner.update(reduced, state, params, **extra)

    return _AllReduceThen(inner.init, update)


class DistributedOptimizer(nnx.Optimizer):
    """An ``nnx.Optimizer`` whose update first averages gradients over replicas.

    Under ``no_sync`` its update adds the gradients to the local accumulator and
    leaves parameters, optimizer state and ``step`` unchanged.
    """

    def __init__(self, optimizer: nnx.Optimizer):  # pylint: disable=super-init-not-called
        # Share the wrapped optimizer's state; only the transformation changes.
        self.graph = optimizer.graph
        self.step = optimizer.step
        self.tx = _distributed_tx(optimizer.tx)
        self.opt_state = nnx.data(optimizer.opt_state)
        self.wrt = optimizer.wrt
        # Replicate the state on the mesh now (Adam's counters and ``step`` sit on
        # one device otherwise), equal on every replica.
        replicate_in_place(self)

    def update(self, model, grads, /, **kwargs):
        trace = _context.current()
        if trace is not None and trace.no_sync:
            grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph))
            reduce_gradients(grad_arrays)
            return jax.tree.map(jnp.zeros_like, grad_arrays)
        return super().update(model, grads, **kwargs)


def distributed_optimizer(optimizer: Any, strategy: Any = None) -> Any:
    """Makes an optimizer average gradients over the data-parallel replicas.

    Args:
        optimizer: an optax ``GradientTransformation`` or an ``nnx.Optimizer``
            (built on the model before or after ``fleet.distributed_model``).
        strategy: accepted for Paddle compatibility; the strategy given to
            ``fleet.init`` (or the ``DataParallel`` in the step) sets the buckets.

    Returns:
        The same kind of optimizer. Its update averages the gradients (one
        ``psum`` per bucket) inside a :func:`fleet.distributed_step`, then runs the
        original update. Gradients averaged already by
        ``fleet.fused_allreduce_gradients`` are not reduced again.

    Example:
        >>> tx = fleet.distributed_optimizer(optax.adam(1e-3))  # doctest: +SKIP
        >>> opt = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
    """
    del strategy
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer
    if isinstance(optimizer, nnx.Optimizer):
        return DistributedOptimizer(optimizer)
    if isinstance(optimizer, optax.GradientTransformation):
        return _distributed_tx(optimizer)
    raise FleetTypeError(
        f"fleet.distributed_optimizer takes an optax.GradientTransformation or an "
        f"nnx.Optimizer, got {type(optimizer).__name__}; build one with e.g. "
        "optax.adam(1e-3) or nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)"
    )
