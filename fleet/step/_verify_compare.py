"""The comparison of ``fleet.step._verify``: a distributed step's results against the
single-device reference, leaf by leaf, each within its noise floor (see
``fleet.step._verify`` for the floor), and the processes' verdicts exchanged so that
every process raises at the same call."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from fleet._errors import FleetError
from fleet.runtime import _agree

CAUSES = {
    "counter": (
        "a metric's or a hand-kept counter or total updated with fleet.all_reduce(..., "
        "'avg') where the global count needs 'sum', or a total taken from one replica's "
        "rows (x.shape[0] inside the step is the replica's rows, not the global batch)"),
    "random": (
        "a random stream made per replica: a key folded with the replica index "
        "(jax.lax.axis_index), or a raw uint32 key fleet cannot re-type, so each replica "
        "draws what one device would draw for the first rows"),
    "output": (
        "an output declared with out_reduce that is not what the step computes (a max "
        "over the batch declared 'mean', a summed loss declared 'sum'), or a value made "
        "from a closed-over array sliced by x.shape[0]"),
    "state": (
        "a loss summed over the batch and declared with out_reduce='sum' (gradients are "
        "averaged over replicas, so they are N times smaller than on one device); a "
        "closed-over array (a numpy array captured by the step) sliced with x.shape[0], "
        "so each replica uses the first rows' values; a random stream folded with the "
        "replica index (jax.lax.axis_index)"),
}


def whole(x: Any) -> Any:
    """The whole value of a step's array on this process: a global array that is
    not all here (a multi-process batch, a gathered output) gathered from every
    process; a replicated one read from this process's copy."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    if x.is_fully_replicated:
        return x.addressable_data(0)
    _agree.join("fleet verify (gathering a global array)")  # bounded, before the collective
    return multihost_utils.process_allgather(x, tiled=True)


def agree(ref: Any, failed: bool) -> None:
    """Multi-process: every process learns whether any found a difference, and one
    that found none raises too, naming the processes that did."""
    if jax.process_count() == 1:
        return
    flags = _agree.agree("fleet verify", "1" if failed else "0")  # (fleet.runtime._agree: bounded)
    if "1" not in flags:
        return
    _agree.raise_together("fleet verify")
    if not failed:
        raise FleetError(
            f"verify, call {ref.call}: process(es) {[r for r, f in enumerate(flags) if f == '1']} "
            "found a result that differs from the single-device step; their error names it")


#: The floor of a leaf that is rounding noise at its own size, in multiples of its
#: largest value in either reference (fleet.step._verify): Adam's second moment of a
#: parameter whose gradient is zero squares the gradient's noise, and two summation
#: orders' noise differ in size by up to 5 times on attention's query and key
#: (25 in the square); 256 = 16 ** 2.
NOISE_SIZES = 256


def _peak(x: np.ndarray) -> float:
    """The largest magnitude in ``x``, NaNs left out (0.0 for none)."""
    return float(np.nanmax(np.abs(x), initial=0.0))


def plain(x: Any) -> np.ndarray:
    x = jnp.asarray(whole(x))
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def compare(name: str, kind: str, got: Any, want: np.ndarray, pert: Any, ref: Any,
             worst: tuple) -> tuple:
    """Raises if ``got`` is beyond the floor; else the worst (ratio, name, d, floor)."""
    got, want, pert = plain(got), plain(want), plain(pert)
    if got.shape != want.shape:
        raise FleetError(
            f"verify, call {ref.call}: {name} has shape {got.shape} in the distributed step "
            f"and {want.shape} on one device ({ref.where}). Usual causes: {CAUSES[kind]}")
    if jnp.issubdtype(want.dtype, jnp.inexact):
        eps = max(float(jnp.finfo(want.dtype).eps), ref.eps)
        g, p, q = (a.astype(np.float64) for a in (got, want, pert))
        d = float(np.max(np.abs(g - p), initial=0.0))
        if np.isnan(d) and np.array_equal(np.isnan(g), np.isnan(p)):
            d = float(np.nanmax(np.abs(g - p), initial=0.0))
        moved, size = _peak(q - p), _peak(p)
        floor = 8 * moved + 16 * eps * size
        if moved > size / 16:  # noise at the leaf's own size (see fleet.step._verify)
            floor = max(floor, NOISE_SIZES * max(size, _peak(q)))
    else:
        d = 0.0 if np.array_equal(got, want) else float(
            np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
        floor = 0.0
    if not d <= floor:
        raise FleetError(
            f"verify, call {ref.call}: {name} differs from the single-device step on the "
            f"global batch ({ref.where}): norm {np.linalg.norm(got.astype(np.float64)):.6g} "
            f"distributed vs {np.linalg.norm(want.astype(np.float64)):.6g} on one device, max "
            f"|difference| {d:.3g} > noise floor {floor:.3g}. Usual causes: {CAUSES[kind]}")
    ratio = d / floor if floor else 0.0
    return max(worst, (ratio, name, d, floor)) if worst[1] else (ratio, name, d, floor)
