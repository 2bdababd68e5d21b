"""ZeRO's probe (``strategy.sharding``): is the optimizer's update on slices the
slice of its whole update?

Before the first sharded step, :func:`verify` runs two steps of the optimizer
on small probe parameters of the model's tree, once whole and once split over
``degree`` simulated replicas (``jax.vmap`` over ``data``), with the
whole-tensor sums completed across slices as in the step
(:mod:`fleet.sections._slices`). A transformation whose sliced update differs (a
whole-tensor quantity other than a sum, factored statistics) is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxprs_in_params

from fleet._errors import FleetError, FleetUnsupportedError
from fleet.comm._shard_comm import own_slice, padded_rows
from fleet.runtime._world import DATA_AXIS
from fleet.sections._sharding import Config, plan, sliced_update


def verify(inner: Any, params: Any, cfg: Config, steps: int = 2) -> None:
    """Refuses a transformation whose update on slices is not the slice of its
    update: two steps on small probe parameters of the same tree, run once whole
    and once split over ``degree`` simulated replicas (``jax.vmap`` over
    ``data``)."""
    rng = np.random.default_rng(0)
    p_leaves, p_def = jax.tree.flatten(params)
    shapes = [tuple(min(d, 3) for d in jnp.shape(p)) for p in p_leaves]
    dtypes = [jnp.result_type(p) for p in p_leaves]
    d = cfg.degree
    probe_cfg = dataclasses.replace(cfg, replicas=d)
    layouts = [probe_cfg.layout(s) for s in shapes]

    def draw(scale=1.0):
        return [jnp.asarray(rng.standard_normal(s) * scale, dt) for s, dt in zip(shapes, dtypes)]

    p0 = draw()
    grads = [draw(0.1) for _ in range(steps)]
    try:
        full_state = inner.init(jax.tree.unflatten(p_def, p0))
        state_layouts = plan(inner.init, jax.tree.unflatten(p_def, p0), probe_cfg)
        ref_updates = _whole_updates(inner, p_def, p0, grads, full_state)

        def replica(r, state_leaves):
            del r
            p_r = [own_slice(x, lay) for x, lay in zip(p0, layouts)]
            s_def = jax.tree.structure(full_state)
            st = jax.tree.unflatten(s_def, list(state_leaves))
            marks = jax.tree.unflatten(s_def, [lay is not None for lay in state_layouts])
            outs = []
            for g in grads:
                g_r = [own_slice(x, lay) for x, lay in zip(g, layouts)]
                u, st = sliced_update(inner, probe_cfg, jax.tree.unflatten(p_def, g_r), st,
                                       marks, jax.tree.unflatten(p_def, p_r))
                u = jax.tree.leaves(u)
                outs.append(u)
                p_r = [a + b for a, b in zip(p_r, u)]
            return outs

        s_full = jax.tree.leaves(full_state)
        s_rows = [jnp.broadcast_to(x, (d, *jnp.shape(x))) if lay is None else
                  padded_rows(x, lay) for x, lay in zip(s_full, state_layouts)]
        got = jax.vmap(replica, axis_name=DATA_AXIS)(jnp.arange(d), s_rows)
    except FleetError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure means fleet cannot split it
        raise FleetUnsupportedError(
            f"strategy.sharding could not run the optimizer on parameter slices "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); use an "
            "elementwise optax optimizer (adam, sgd, lamb, lars...) or turn "
            "strategy.sharding off") from e
    _compare(params, ref_updates, got, layouts,
             lambda: _draws(inner, p_def, p0, grads[0], full_state))


def _draws(inner: Any, p_def: Any, p0: list, g: list, state: Any) -> bool:
    """Whether the optimizer's update draws random numbers (``optax.noisy_sgd``,
    ``optax.add_noise``)."""
    def update(g, state, p):
        return inner.update(jax.tree.unflatten(p_def, g), state, jax.tree.unflatten(p_def, p))

    def any_draw(jaxpr: Any) -> bool:
        return any(e.primitive.name == "random_bits"
                   or any(any_draw(sub) for sub in jaxprs_in_params(e.params))
                   for e in getattr(jaxpr, "jaxpr", jaxpr).eqns)

    return any_draw(jax.make_jaxpr(update)(g, state, p0))


def _whole_updates(inner: Any, p_def: Any, p0: list, grads: list, full_state: Any) -> list:
    """The reference: the optimizer's updates (leaves) of each probe step on the
    whole probe parameters ``p0``, each applied before the next."""
    ref_updates, p = [], p0
    state = full_state
    for g in grads:
        u, state = inner.update(jax.tree.unflatten(p_def, g), state,
                                jax.tree.unflatten(p_def, p))
        u = jax.tree.leaves(u)
        ref_updates.append(u)
        p = [a + b for a, b in zip(p, u)]
    return ref_updates


def _compare(params: Any, ref_updates: list, got: list, layouts: list,
             draws: Callable[[], bool]) -> None:
    """Refuses the optimizer at the first parameter (named by its path in
    ``params``) and step whose update on slices, ``got``, differs from the slice
    of its whole update, ``ref_updates``; ``draws()``: whether the update draws
    random numbers (then that is the reason; traced only for a refusal)."""
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(params)[0]]
    for step, (ref, sliced) in enumerate(zip(ref_updates, got)):
        for path, want, r, lay in zip(paths, ref, sliced, layouts):
            have = np.asarray(r).reshape(-1)[:lay.size].reshape(lay.shape)
            want = np.asarray(want)
            tol = 1e-5 * (1.0 + float(np.max(np.abs(want), initial=0.0)))
            if not np.allclose(have, want, rtol=0, atol=tol):
                raise FleetUnsupportedError(
                    f"strategy.sharding: the optimizer's update of parameter {path} on "
                    f"slices differs from the slice of its whole update (step {step + 1} of "
                    "a probe, max difference "
                    f"{float(np.max(np.abs(have - want))):.2e}): " + (
                        _DRAWS if draws() else _WHOLE_TENSOR))


_WHOLE_TENSOR = (
    "it is not elementwise and uses a whole-tensor quantity fleet cannot split (only sums "
    "over whole tensors, such as norms, are computed across slices). Use an elementwise "
    "optimizer, LAMB, LARS or optax.clip_by_global_norm, or turn strategy.sharding off")
_DRAWS = (
    "it draws random numbers (optax.noisy_sgd, optax.add_noise), and a draw over a slice "
    "is not the slice of the draw over the whole tensor. Turn strategy.sharding off (each "
    "replica then draws the single-device noise), or use an optimizer without noise")
