"""``strategy.verify_steps`` / ``FLEET_VERIFY_STEPS``: the user's own step checked
against one device.

For the first k calls of each compiled plan of a :class:`fleet.DistributedStep`,
the single-device step runs beside the distributed one: ``nnx.jit`` of the
user's function, outside any fleet step (where a wrapped model, a distributed
optimizer and a global metric behave as the plain single-device ones), on
copies of the NNX objects' state, of the pytree arguments and of the *global*
batch, all on one device (the mesh's first; the host's CPU where state and
batch, three times over, do not fit in the device's free memory). Then every
state leaf of the step's NNX objects (parameters, optimizer state, buffers,
metrics' totals and counts, RNG keys and counts) and every output leaf (by
pytree path; a returned ``TrainState`` is an output) is compared; the first leaf
beyond its noise floor raises a :class:`fleet.FleetError` naming it, the call,
both norms, the difference and the floor, and the usual causes.

The noise floor. The tests compare fleet with the *split-sum* step (the
single-device step whose gradient is the mean of the replicas' sub-batch
gradients): the distance between it and the plain step is how far summation
order alone moves a result. fleet cannot build that reference for a user's
step: it cannot cut an arbitrary function into sub-batch gradients. It builds
a stand-in that measures the same thing, the step's sensitivity to
rounding-level changes: the reference runs twice, plain and with every float
leaf of the state and the batch multiplied by ``1 + delta`` (``2**-20`` for
float32/64, ``2**-10`` for float16/bfloat16 and under ``strategy.amp`` or
``fp16_allreduce``; keys and integers untouched). Per leaf, ``floor = 8 *
max|perturbed - plain| + 16 * eps * max|plain|``, eps the leaf dtype's, or
more where the distributed step rounds on purpose: amp's compute dtype (float16
amp scales the loss inside the step, which the plain step does not, and
float32 state such as Adam's moments then carries float16 rounding), and the
16-bit dtype ``fp16_allreduce``'s gradients travel in;
integer leaves and keys must be equal. A chaotic leaf
(Adam's update of a bias whose gradient is zero) moves by about the learning
rate under either change, and gets a wide floor; a leaf that rounding barely
moves keeps a tight one. A leaf that is rounding noise at its own size (the
perturbation moved it by more than a sixteenth of its largest value: Adam's
moments of a parameter whose gradient is zero, 1e-20 to 1e-17) has no value
to compare, only a size: its floor is at least 256 times its largest value in
either reference (``NOISE_SIZES``: the noise of two summation orders differs in
size by up to 5 times there, 25 times in the square). Before, such a leaf's two
samples of noise, the perturbed one and the distributed one, were not within 8
times each other often enough: verify refused correct steps (attention's query
and key on a repeated token with Adam, 4 and 8 replicas: tests/test_verify.py's
``zero_gradient``). A leaf the step really changes is far above its noise (a
gradient that should be zero and is not gives a second moment near the other
parameters', not 1e-18). tests/test_verify.py checks that on the contract
tests' models this floor is at least the split-sum one.

The sections whose state has no plain single-device value
(``fleet.step._verify_sections``): ``strategy.sharding`` (stages 1 and 2) is compared
in the logical layout (each sharded optimizer-state leaf, NNX variable or a
Linen ``TrainState``'s ``Shard``, gathered from the replicas' chunks into the
parameter's shape; the reference runs the inner transformation on the whole
state). ``no_sync`` and ``strategy.gradient_merge``: the reference keeps its
own single-device sum of the global-batch gradients across the calls it
checks (plain and perturbed each their own), adds to it on an accumulating call
(which steps nothing, on either side) and steps with it on the call that applies
it (divided by ``k_steps`` under ``gradient_merge_configs.avg``): what
``optax.MultiSteps`` does on one device. fleet's per-replica ``grad_accum`` is
not compared; a call that adds to or applies a sum begun on calls verify did
not check (a restored mid-cycle checkpoint, calls past the k of their plan) is
skipped, and said.

Multi-process jobs: every process gathers the global batch (and the outputs
that are not all on it) and runs the reference on its own first device; each
compares the same global values, and the verdicts are exchanged, so every
process raises at the same call. Process 0 prints the lines.

``strategy.sync_batch_norm=False``: the reference is the documented one, each
replica's rows normalised apart: the clone's ``nnx.BatchNorm`` layers split the
batch into the replicas' rows, normalise each with its own statistics and
average the running ones (``fleet.step._verify_sections.per_replica_batch_norm``); a
wrapped Linen module's ``nn.BatchNorm`` layers do the same while the reference
runs (``fleet.sections._batch_norm.per_replica_reference``). fleet's own
bookkeeping (float16 amp's loss scale, gradient merge's count, ``no_sync``
accumulators) is not compared: the single-device step has none.

Cost: two single-device runs (compiled once per plan) and the copies, for k
calls per plan; with verify off, a call reads one attribute (``active``).
``benchmarks/verify_cost.py``, 4 fake CPU devices on a 2-core machine, Adam:
the 2.1M MLP 41.6 ms a plain call, 311 ms a verified one (first: 3.9 s,
compiling the reference), 50 MiB copied to one device; the CIFAR CNN 149 ms,
1001 ms (first: 8.7 s), 5.8 MiB.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleet._errors import FleetConfigError, FleetError
from fleet.comm import _sync
from fleet.comm._buckets import strategy_buckets
from fleet.runtime._leaves import dotted
from fleet.runtime._world import world
from fleet.sections import _sharding
from fleet.sections._amp import LossScale, policy_of
from fleet.step import _roles
from fleet.step import _verify_reference as reference
from fleet.step import _verify_sections as sections
from fleet.step._verify_compare import agree, compare, whole
from fleet.wrappers._gradient_merge import MergeCount

ENV = "FLEET_VERIFY_STEPS"
_OWN = (MergeCount, LossScale, _sync.PerReplica)  # fleet's bookkeeping: not compared


def steps_from(strategy: Any) -> int:
    """k: ``FLEET_VERIFY_STEPS`` when set, else ``strategy.verify_steps``."""
    raw = os.environ.get(ENV)
    if raw is None or raw.strip() == "":
        return strategy.verify_steps
    try:
        k = int(raw)
    except ValueError:
        k = -1
    if k < 0:
        raise FleetConfigError(
            f"{ENV}={raw!r} must be 0 (off) or a positive number of calls to check "
            "against one device, e.g. FLEET_VERIFY_STEPS=3")
    return k


class Reference:
    """One verified call: the plain and perturbed single-device results."""

    def __init__(self, call: int, device: Any, where: str, plain: tuple, perturbed: tuple,
                 failed: Exception | None = None):
        self.call, self.device, self.where = call, device, where
        self.plain, self.perturbed = plain, perturbed  # (state leaves, outputs)
        self.owners: list[str] = plain[2] if plain else []  # per state leaf: "counter" or "state"
        self.failed = failed  # the single-device step's own error, if it raised
        self.eps = 0.0  # strategy.amp: its compute dtype's eps, at least
        self.mode: tuple = (False, False, 1)  # accumulates, applies, divisor
        self.note = ""  # accumulated gradients: which call of the sum


class Verify:
    """A step's verify mode: which plans were checked, and how often."""

    def __init__(self, fn: Any):
        self.fn = fn
        self.active = True  # until k is known to be 0
        self.k: int | None = None
        self._calls: dict[Any, int] = {}
        self._jitted: dict[Any, Any] = {}
        self._sums = sections.Accumulation()  # no_sync, gradient_merge: the reference's sums

    def before(self, plan: Any, kinds: tuple, args: tuple, kwargs: dict,
               batch: list) -> Reference | None:
        """Runs the single-device step on copies of this call's arguments (before
        the distributed call donates the state; ``batch``: the global batch as the
        step placed it); ``None`` when not verified."""
        w = world()
        if self.k is None:
            self.k = steps_from(w.strategy)
            if self.k == 0:
                self.active = False
                return None
        n = self._calls.get(plan, 0)
        if n >= self.k and self._sums.idle(plan):  # (verified: nothing to follow either)
            return None
        values = list(args) + [kwargs[k] for k in plan.kw_names]
        objs = tuple(v for v, k in zip(values, kinds) if k == _roles.NNX)
        mode = self._sums.mode(plan, objs, verified=n < self.k)
        if n >= self.k:
            return None
        if mode is None:
            _say("fleet verify: skipped this call: it adds to or applies gradients "
                 "accumulated (no_sync, gradient_merge) on calls verify did not check")
            return None
        self._calls[plan] = n + 1
        rows = iter(batch)  # every process: the whole global batch, in the step's order
        values = [whole(next(rows)) if k == _roles.BATCH else v for v, k in zip(values, kinds)]
        device, where = reference.device(w, values, kinds)
        jitted = self._jitted.get(plan)
        if jitted is None:
            jitted = self._jitted[plan] = reference.reference_fn(self.fn, kinds, plan.kw_names)
        delta = _delta(w.strategy)
        sums = self._sums.sums
        try:
            plain = reference.run(jitted, values, kinds, device, False, mode, sums[0])
            perturbed = reference.run(jitted, values, kinds, device, delta, mode, sums[1])
        except FleetError:
            raise
        except Exception as e:  # noqa: BLE001 (the user's step, on one device)
            # The distributed call runs next: a step fleet refuses raises its own error
            # there, naming the cause; one fleet runs gets this one (after).
            self._calls[plan] = self.k
            return Reference(n + 1, device, where, (), (), failed=e)
        self._sums.done(mode[0], mode[1], (plain[3], perturbed[3]))
        ref = Reference(n + 1, device, where, plain, perturbed)
        ref.eps = _eps(w.strategy)  # amp, fp16_allreduce: results carry 16-bit rounding
        ref.mode = mode
        if mode[0] or mode[1]:
            ref.note = (" (gradients accumulated)" if mode[0] else
                        f" (accumulated gradients applied{f', / {mode[2]}' * (mode[2] > 1)})")
        return ref

    def after(self, ref: Reference, plan: Any, graph: Any, out: Any) -> None:
        """Compares the distributed call's state and outputs with the reference; in
        a multi-process job every process raises at the same call (each compares
        the same global values; their verdicts are exchanged all the same)."""
        if ref.failed is not None:
            why = (str(ref.failed).splitlines() or [""])[0]
            raise FleetError(
                f"verify, call {ref.call}: the distributed step ran, but the same step "
                f"function fails as the single-device step on the global batch "
                f"({ref.where}): {type(ref.failed).__name__}: {why}. verify "
                "compares with that step, so it cannot check this one; run the script on one "
                "device to see the failure, or turn verify off") from ref.failed
        try:
            worst = self._compare_all(ref, graph, out)
        except FleetError as e:
            agree(ref, failed=True)
            raise e from None
        agree(ref, failed=False)
        k = self.k
        if jax.process_index() == 0:
            _say(f"fleet verify: call {ref.call} of {k}{ref.note} matches one device ({ref.where}): "
                 f"worst leaf {worst[1]}: |d| {worst[2]:.1e} <= floor {worst[3]:.1e}")
            if ref.call == k and not ref.mode[0]:
                _say(f"fleet verify: {k} call{'s' * (k > 1)} of this step matched one device; "
                     "verify is now off for it")

    def _compare_all(self, ref: Reference, graph: Any, out: Any) -> tuple:
        state = [v.get_raw_value() for v in graph.variables]
        rows = [(name, v, x) for name, v, x in zip(graph.names, graph.variables, state)]
        worst = (0.0, "", 0.0, 0.0)
        for i, (name, var, got) in enumerate(rows):
            if isinstance(var, _OWN) and _sharding.layout_of(var) is None:
                continue
            got = sections.fleet_value(var)  # strategy.sharding: logical
            kind = "random" if isinstance(var, nnx.RngState) else ref.owners[i]
            worst = compare(f"{name}", kind, got, ref.plain[0][i], ref.perturbed[0][i],
                             ref, worst)
        got_out = jax.tree_util.tree_flatten_with_path(sections.logical_tree(out))[0]
        plain_out = jax.tree_util.tree_flatten_with_path(ref.plain[1])[0]
        pert_out = jax.tree.leaves(ref.perturbed[1])
        if [p for p, _ in got_out] != [p for p, _ in plain_out]:
            raise FleetError(
                f"verify, call {ref.call}: the distributed step returned outputs "
                f"{[dotted(p) for p, _ in got_out]}, one device "
                f"{[dotted(p) for p, _ in plain_out]}")
        for (path, got), (_, want), pert in zip(got_out, plain_out, pert_out):
            worst = compare(f"output {dotted(path)}" if path else "the output", "output", got,
                             want, pert, ref, worst)
        return worst


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _delta(strategy: Any) -> float | None:
    """The perturbation: 16-bit rounding under amp or fp16_allreduce (None: by dtype)."""
    return 2.0 ** -10 if strategy.amp or strategy.fp16_allreduce else None


def _eps(strategy: Any) -> float:
    """The rounding the distributed step adds on purpose: amp's compute dtype, the
    16-bit dtype fp16_allreduce's gradients travel in (fleet.comm._buckets); else 0."""
    wire = strategy_buckets().wire_dtype
    dtypes = [p.dtype for p in (policy_of(strategy),) if p is not None] + [wire] * bool(wire)
    return max((float(jnp.finfo(d).eps) for d in dtypes), default=0.0)
