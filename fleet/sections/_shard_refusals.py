"""What a sharded update (``strategy.sharding``, :mod:`fleet.sections._sharding`)
refuses: running outside a step's trace, or on gradients that the wrapped
model's backward pass did not leave.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fleet._errors import FleetError
from fleet.comm import _sync
from fleet.comm._shard_comm import own_slice
from fleet.comm._synced import raw_read_hint


def sharded_trace() -> _sync.SyncTrace:
    """The step's trace, where a sharded update runs; raises outside one."""
    trace = _sync.current()
    if trace is not None and trace.shard.config is None:
        raise FleetError(
            "this optimizer state was split by fleet.distributed_optimizer(tx).init "
            "(strategy.sharding) and is held where the step cannot see it (an nnx.Optimizer "
            "built on a distributed optax transformation); for NNX write "
            "fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))")
    if trace is None:
        raise FleetError(
            "this optimizer's state is sharded (strategy.sharding), and it updates only "
            "inside a fleet.distributed_step that differentiates the wrapped model")
    return trace


def not_the_backwards(trace: _sync.SyncTrace, grads: Any, params: Any, missing: list,
                      found: list) -> None:
    """Refuses gradients (``missing``) that the wrapped model's backward pass did
    not leave. In the probe the refusal waits for its checks, which name a more
    specific cause first (a raw parameter read in the loss, whose gradient JAX
    summed: fleet.step._probe_checks.check_gradients): ``found`` gets stand-in
    slices (the parameters', times zero) so that the trace goes on."""
    cfg = trace.shard.config  # (fleet.sections._sharding.Config)
    path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(grads)[0][missing[0]][0])
    message = (
        f"strategy.sharding: the optimizer got a gradient ({path}) that is not the one "
        "the wrapped model's backward pass returned: it was changed after nnx.grad / "
        "jax.grad (clipped, scaled, added to) or computed another way. Under sharding "
        "each replica holds only its slice of the reduced gradient, so make such "
        "changes inside the optax chain (optax.clip_by_global_norm, optax.scale...), "
        "or turn strategy.sharding off")
    if cfg.stage == 3:
        message += ". " + raw_read_hint("the loss")
    p_leaves = jax.tree.leaves(params) if params is not None else []
    if trace.shard.refusals is None or len(p_leaves) != len(found):
        raise FleetError(message)
    trace.shard.refusals.append(message)
    for i in missing:
        p = p_leaves[i]
        held = p if cfg.stage == 3 else own_slice(p, cfg.layout(jnp.shape(p)))
        found[i] = (path, held * 0, True)
