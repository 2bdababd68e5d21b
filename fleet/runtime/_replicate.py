"""State placed replicated on the mesh, every replica holding process 0's values.

One home for what the model, the optimizer, ``fleet.Model`` saving and the
checkpoints all need to place state: a tree replicated (:func:`replicate`), an
object's variables set from named host values, all or nothing
(:func:`load_state_dict`), after checking every process holds the same names,
shapes and dtypes. Names and host copies: :mod:`fleet.runtime._leaves`.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from fleet._errors import FleetError, FleetTypeError
from fleet.runtime._agree import agree, raise_together
from fleet.runtime._leaves import dotted, like, module_variables, to_host
from fleet.runtime._world import world


def load_state_dict(obj: nnx.Pytree, values: dict[str, Any], what: str, hint: str,
                    intro: str | None = None) -> None:
    """Sets every variable of ``obj`` from ``values`` (by dotted path), replicated;
    all or nothing: any missing, unexpected or mis-shaped key raises a FleetError
    that lists them (``what`` names the object, ``hint`` says what to do)."""
    current = module_variables(obj)
    problems = [f"missing {k!r}" for k in current if k not in values]
    problems += [f"unexpected {k!r}" for k in values if k not in current]
    for key, value in values.items():
        if key in current:
            old, new = to_host(current[key].get_value()), np.asarray(value)
            if old.shape != new.shape or old.dtype != new.dtype:
                problems.append(f"{key!r}: {what} has {old.shape} {old.dtype}, given "
                                f"{new.shape} {new.dtype}")
    if problems:
        raise FleetError(
            (intro or f"the state does not fit the {what}") + ": " + "; ".join(problems[:8])
            + ("; ..." if len(problems) > 8 else "") + f". {hint}"
        )
    # (a ZeRO stage-3 parameter splits what it is set to: fleet.comm._sync)
    set_replicated(current, {k: like(v.get_value(), np.asarray(values[k]))
                             for k, v in current.items()})


def _check_same_across_processes(call: str, paths: list[str], leaves: list[np.ndarray]) -> None:
    """Every process holds the same names, shapes and dtypes (one bounded
    :func:`fleet.runtime._agree.agree`: a process that never comes is named)."""
    desc = [zlib.crc32(f"{p}:{x.shape}:{x.dtype}".encode()) for p, x in zip(paths, leaves)]
    tables = [json.loads(v) for v in agree(call, json.dumps(desc))]
    if any(t != tables[0] for t in tables):
        raise_together(call)  # every process raises its own error, process 0 last
    counts = [len(t) for t in tables]
    if len(set(counts)) != 1:
        raise FleetError(
            f"processes hold models of different sizes (parameter counts per process: "
            f"{counts}); every process must build the same model"
        )
    for i, path in enumerate(paths):
        column = [t[i] for t in tables]
        bad = next((rank for rank, d in enumerate(column) if d != column[0]), None)
        if bad is not None:
            raise FleetError(
                f"parameter {path!r} differs in shape or dtype between process 0 and "
                f"process {bad} (here: shape {leaves[i].shape}, dtype {leaves[i].dtype}); "
                "every process must build the same model"
            )


def replicate(tree: Any) -> Any:
    """Places every array leaf of ``tree`` replicated on the mesh, equal everywhere.

    Values come from the first device of process 0 (broadcast to the others),
    after checking that every process has the same shapes and dtypes. PRNG key
    arrays travel as their key data and are wrapped again. Collective: every
    process must call it (it waits at most ``FLEET_AGREE_TIMEOUT`` seconds).
    """
    w = world()
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [dotted(p) for p, _ in paths_leaves]
    host = [to_host(x) for _, x in paths_leaves]
    if jax.process_count() > 1:
        _check_same_across_processes(
            "placing replicated state (fleet.distributed_model / distributed_optimizer / "
            "set_state_dict)", paths, host)
        host = list(multihost_utils.broadcast_one_to_all(host))
    placed = [jax.make_array_from_callback(h.shape, w.replicated, lambda idx, h=h: h[idx])
              for h in host]
    placed = [like(x, p) for (_, x), p in zip(paths_leaves, placed)]  # (PRNG keys wrapped)
    return jax.tree_util.tree_unflatten(treedef, placed)


def set_replicated(variables: dict[str, nnx.Variable], values: dict[str, Any]) -> None:
    """Sets each variable to its value, replicated (see :func:`replicate`)."""
    placed = replicate(values)
    for key, var in variables.items():
        var.set_value(placed[key])


def refuse_raw_arrays(state: Any, what: str) -> None:
    """Refuses NNX state (``nnx.state`` of ``what``) that holds arrays outside
    ``nnx.Variable``s: Flax lets a module keep ``self.table = jnp.ones(4)`` (its
    own ``nnx.WeightNorm`` keeps its scales so), fleet keeps state in variables."""
    raw = [dotted(p) for p, x in nnx.to_flat_state(state)
           if not isinstance(x, nnx.Variable) and isinstance(x, (jax.Array, np.ndarray))]
    if raw:
        names = ", ".join(repr(r) for r in raw[:4]) + (" ..." if len(raw) > 4 else "")
        raise FleetTypeError(
            f"{what} keeps arrays as plain attributes, outside nnx.Variables: {names}. "
            "fleet places, steps and saves an NNX object's state through its variables: "
            "wrap each one, e.g. self.table = nnx.Variable(jnp.ones(4)) for a constant "
            "(nnx.Param to train it), and read it as self.table[...]. (nnx.WeightNorm "
            "keeps its scales so: nnx.WeightNorm(..., use_scale=False) keeps none.)")


def refuse_pytree_values(state: Any, what: str) -> None:
    """Refuses NNX state (``nnx.state`` of ``what``) with a variable that holds a
    list, tuple or dict of arrays: optax.sm3's state keeps one list of per-axis
    accumulators per parameter, which ``nnx.Optimizer`` puts in one variable. A
    fleet step keeps one array per variable (its placement, donation and
    replica checks go variable by variable); such a variable failed inside the
    step's single-device check, which then said that the step fails on one device."""
    for path, v in nnx.to_flat_state(state):
        value = v.get_raw_value() if isinstance(v, nnx.Variable) else None
        if not isinstance(value, (list, tuple, dict)):  # (an array; ZeRO's Shard of one)
            continue
        shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(value)]
        if shapes:
            raise FleetTypeError(
                f"{what} variable {dotted(path)!r} holds a {type(value).__name__} of "
                f"{len(shapes)} array{'s' * (len(shapes) > 1)} (shape"
                f"{'s' * (len(shapes) > 1)} {', '.join(map(str, shapes))}), where a fleet "
                "step keeps one array per variable: optax.sm3's state holds such lists (one "
                "accumulator per axis of each parameter). Use an optimizer whose state is "
                "arrays (optax.adafactor factors its second moments into arrays too), or "
                "keep each array in a variable of its own")


def replicate_in_place(obj: nnx.Pytree) -> None:
    """Makes every variable of ``obj`` replicated on the mesh, equal everywhere."""
    state, what = nnx.state(obj), f"this {type(obj).__name__}"
    refuse_raw_arrays(state, what)
    refuse_pytree_values(state, what)
    variables = module_variables(obj)
    set_replicated(variables, {k: v.get_raw_value() for k, v in variables.items()})
