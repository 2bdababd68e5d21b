"""A plan's first trace: the probe and the real program in one trace of the step.

The first call of a plan used to trace the step three times: on one device (the
guards' reference, ``fleet.step._guards.check_on_one_device``), as the probe (a
trace that records what the step did, which the guards read), and for real,
with the probe's decisions. On a deep model each trace is seconds; the real
trace is now folded into the probe. The probe's body runs the real program's
tail too -- the outputs' sums, finite flags, state selection, outputs stacked or
replicated -- as one call named :data:`TAIL`, after the probe's own outputs, and
returns both. The guards read :func:`probe_view`: the probe's jaxpr as it was
(the tail's call and outputs left out), beside the one-device reference. When
the decisions they made are the ones the tail assumed (:func:`forms`, and
neither JAX's summed gradients divided by the optimizer nor a metric's varying
scalar: see :func:`reusable`), the real program is the probe's jaxpr, evaluated
(:func:`evaluate`) -- no third trace. Otherwise the step is traced for real
with the decisions, as before.

A first call thus traces the step twice (the reference and the probe), and a
repeated call with the same shapes not at all (``fleet.step._recall``). The
compiled program is the one the third trace made (a CNN with Adam on 4 CPU
devices, with and without ``check_nan_inf``: the optimized HLO is the same but
for one instruction's name). The probe's jaxpr is copied into the real
program's trace as it is (``fleet._compat.inline_jaxpr``), not bound again.

The program compiles while the step is checked
(``fleet.step._jitted.first_program``): the probe is traced first
(``Program.speculate``), its program lowered on the decisions the tail assumed
(outside the body: an integer scalar summed, any other a mean; a distributed
optax optimizer's raw-parameter gradients typed the same on every replica
divided by N, as sums JAX made: a Linen ``TrainState``'s), and XLA
compiles it in a thread (the compilation releases the GIL) while the calling
thread traces the one-device reference and runs the guards
(``Program.settle``). Nothing runs before they passed (the state is donated);
their errors are raised once the thread has ended, as before (a probe that
fails raises the reference's error first, as when the reference was traced
first). When the guards decided what the probe assumed, ``jit``'s cache holds
the compiled program and the call runs it (one compilation); when only the
combination outside the body differs, the probe's jaxpr is evaluated again
with the decisions (no third trace; a second compilation); otherwise the step
is traced for real, as before.

The cost against hand-written steps, and where the time goes, is in
docs/measurements.md ("Time to the first step"; ``benchmarks/first_step.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr

from fleet import _compat
from fleet._errors import FleetError
from fleet.step import _guards
from fleet.step._graph import Plan
from fleet.step._record import PlanRecord
from fleet.wrappers import _data_parallel

#: The name of the call that holds the real program's tail in the probe's body.
TAIL = "fleet_real_tail"

#: How an output leaves the body: the same on every replica (``P()``), stacked
#: per replica (``x[None]``, combined outside), or as the step returned it
#: (gathered rows, ``P(data)``).
REPLICATED, STACKED, AS_IS = "replicated", "stacked", "as is"


def named_tail(tail: Callable[[], Any]) -> Callable[[], Any]:
    """``tail`` as one call named :data:`TAIL` (it closes over its inputs, so the
    values it reads are the very ones the step made)."""
    def fleet_real_tail() -> Any:
        return tail()

    return jax.jit(fleet_real_tail)


def forms(reduces: list, summed: list, combined: Any) -> list[str]:
    """Each output's form (``combined``: the reductions applied to stacked
    outputs outside the body)."""
    return [REPLICATED if r == "replicated" or s
            else STACKED if r in combined or isinstance(r, tuple)
            else AS_IS for r, s in zip(reduces, summed)]


def reusable(record: PlanRecord, assumed: list[str], decided: list[str]) -> bool:
    """Whether the probe's tail is the real program's: the outputs leave the body
    as the tail assumed, the optimizer divided the gradients JAX summed
    (``auto_sum``: a Linen ``TrainState``, raw parameters) as the probe assumed
    it must, and each varying scalar a metric got combines as the probe assumed
    (fleet.semantics._metrics)."""
    return (assumed == decided and record.auto_sum == record.sum_assumed
            and record.metric_scalars == record.metric_assumed)


def probe_view(closed: ClosedJaxpr, outputs: int) -> ClosedJaxpr:
    """The probe's jaxpr as the guards read it: its ``shard_map`` body without the
    :data:`TAIL` call (and what follows it), returning its first ``outputs``
    values only."""
    eqns = list(closed.jaxpr.eqns)
    at = next(i for i, e in enumerate(eqns) if e.primitive.name == "shard_map")
    shmap = eqns[at]
    body = shmap.params["jaxpr"]
    inner = body.eqns
    cut = next((i for i, e in enumerate(inner) if e.params.get("name") == TAIL), len(inner))
    body = body.replace(eqns=inner[:cut], outvars=body.outvars[:outputs])
    params = dict(shmap.params, jaxpr=body, out_specs=shmap.params["out_specs"][:outputs])
    eqns[at] = shmap.replace(params=params, outvars=shmap.outvars[:outputs])
    kept = set(map(id, shmap.outvars[:outputs]))
    outvars = [v for v in closed.jaxpr.outvars if id(v) in kept]
    return closed.replace(jaxpr=closed.jaxpr.replace(eqns=eqns, outvars=outvars))


def evaluated(closed: ClosedJaxpr, shape: Any, args: tuple, decided: list[str]) -> tuple:
    """The real program in the probe's jaxpr on ``args`` (:func:`evaluate`): its new
    state, its outputs in order (as ``decided`` groups them) and its chain (a
    list, empty without check_nan_inf)."""
    new_state, replicated, rest, *checked = evaluate(closed, shape, args)
    return new_state, ungroup(replicated, rest, decided), checked


def evaluate(closed: ClosedJaxpr, shape: Any, args: tuple) -> Any:
    """The real program in the probe's jaxpr, on ``args`` (in the trace that calls
    it): the probe's own outputs and what only they need left out (so the
    program lowered is the one a trace of the real body makes), its outputs in
    the structure of the probe body's, but the first. Its equations are copied
    into the calling trace as they are (``fleet._compat.inline_jaxpr``: the
    optimized HLO is the one that binding each again made, 0.3 s faster on the
    16-layer Transformer of ``benchmarks/first_step.py``)."""
    probed = len(jax.tree.leaves(shape[0]))
    total = len(closed.jaxpr.outvars)
    real, used = _compat.without_dead_code(closed, [i >= probed for i in range(total)])
    flat = [x for x, u in zip(jax.tree.leaves(args), used) if u]
    return jax.tree.unflatten(jax.tree.structure(shape[1:]), _compat.inline_jaxpr(real, flat))


def ungroup(replicated: list, rest: list, decided: list[str]) -> list:
    """The outputs in order, from the body's two groups (its ``P()`` outputs and
    the others)."""
    groups = iter(replicated), iter(rest)
    return [next(groups[f != REPLICATED]) for f in decided]


def scaled_reference(plan: Plan, reference: Any, probe_body: Callable, args: tuple,
                      specs: tuple) -> Callable[[], Any]:
    """The single-device trace with more rows that fleet.semantics._outputs reads a
    reduction from: the replay itself (the global batch) on several replicas; on
    one, a trace with twice the rows, made once when first asked for (None for a
    step written for one batch size, where any rule is exact)."""
    if plan.mesh.devices.size > 1:
        return lambda: reference
    made: list = []

    def scaled() -> Any:
        if not made:
            try:
                made.append(_guards.check_on_one_device(probe_body, plan.mesh, args, specs,
                                                        rows=2))
            except FleetError:
                made.append(None)
        return made[0]

    return scaled


def with_copies_hint(error: FleetError, objs: tuple) -> FleetError:
    """``error``, with a hint when the step holds a copy of a wrapped model made
    before the wrapping (``fleet.wrappers._data_parallel.copies_made_before_wrapping``)."""
    copies = _data_parallel.copies_made_before_wrapping(objs)
    if not copies:
        return error
    hint = (f". The step holds both the wrapped {copies[0]} and a plain {copies[0]}: a copy "
            "made before fleet.distributed_model wrapped it (an EMA, a teacher)? Their "
            "pytree structures differ (DataParallel[...] is the wrapped model's class), so "
            "a jax.tree.map over both fails. Make the copy from the wrapped model: wrap "
            "first, then build what copies it")
    return type(error)(str(error) + hint).with_traceback(error.__traceback__)
