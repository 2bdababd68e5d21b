"""Issue 24, item 1: ``check_nan_inf``'s select and ZeRO's gather cost no step
memory, and change no result.

* ``check_nan_inf`` selects the state where the optimizer makes it (the update
  replayed under the chain, fleet/sections/_finite.py): the compiled step holds no copy
  of the optimizer state, and a finite call leaves the same bits as without the
  check;
* ZeRO (fleet/sections/_sharding.py) gathers the new parameters, not the updates
  added to the full parameters afterwards, and gathers a bucket as a list, not
  one concatenated buffer: stage 2 holds no more than a hand-written sharded
  step, and the new parameters are the old ones plus the whole updates, bitwise.

Memory is ``compile().memory_analysis()``'s bytes live at the step boundary:
arguments + outputs + temporaries - aliased (benchmarks/donation.py measures the
issue's models).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fleet
from tests.tiers import slow, stages

N = 4
SIZES = (64, 256, 256, 10)  # two 256-wide layers: their moments dominate the state


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(SIZES[:-1], SIZES[1:])])

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def loss_of(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def batch(seed: int = 0, n: int = 32):
    rng = np.random.RandomState(seed)
    return (rng.randn(n, SIZES[0]).astype(np.float32),
            rng.randint(0, SIZES[-1], n).astype(np.int32))


def live(lowered) -> int:
    m = lowered.compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


def train(model, opt, x, y):
    loss, grads = nnx.value_and_grad(loss_of)(model, x, y)
    opt.update(model, grads)
    return loss


def setup(make_world, strategy, tx=None):
    make_world(N, strategy)
    model = fleet.distributed_model(MLP(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(
        nnx.Optimizer(model, tx or optax.adam(1e-2), wrt=nnx.Param))
    return model, opt


def fleet_live(make_world, strategy) -> int:
    model, opt = setup(make_world, strategy)
    step = fleet.distributed_step(train)
    x, y = batch()
    if strategy.sharding:  # the state is split at the first call
        step(model, opt, x, y)
    return live(step.lower(model, opt, x, y))


def hand_sharded_live() -> int:
    """A hand-written ZeRO step, donating: gradients reduce-scattered, Adam on each
    device's slice, the new parameters all-gathered."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    tx = optax.adam(1e-2)
    leaves, treedef = jax.tree.flatten(params)
    pad = [(-p.size) % N for p in leaves]

    def flat(tree):
        return [jnp.pad(v.reshape(-1), (0, k)) for v, k in zip(jax.tree.leaves(tree), pad)]

    def body(params, opt_state, x, y):
        varying = jax.tree.map(lambda v: jax.lax.pcast(v, "data", to="varying"), params)
        loss, grads = jax.value_and_grad(
            lambda p: loss_of(nnx.merge(graphdef, p), x, y))(varying)
        i = jax.lax.axis_index("data")
        g = [jax.lax.psum_scatter(v, "data", scatter_dimension=0, tiled=True) / N
             for v in flat(grads)]
        p = [jax.lax.dynamic_slice_in_dim(v, i * (v.size // N), v.size // N)
             for v in flat(params)]
        updates, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, jax.lax.pmean(loss, "data")

    opt_state = tx.init(flat(params))
    specs = jax.tree.map(lambda v: P("data") if v.ndim else P(), opt_state)
    run = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                        out_specs=(P("data"), specs, P()))

    def outer(params, opt_state, x, y):
        new, opt_state, loss = run(params, opt_state, x, y)
        new = jax.tree.unflatten(treedef, [v[:v.size - k].reshape(o.shape)
                                           for v, k, o in zip(new, pad, leaves)])
        return new, opt_state, loss

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), (P(), specs, P()))
    step = jax.jit(outer, donate_argnums=(0, 1), out_shardings=shardings)
    data = NamedSharding(mesh, P("data"))
    x, y = batch()
    return live(step.lower(
        jax.device_put(params, NamedSharding(mesh, P())),
        jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), opt_state, specs),
        jax.device_put(x, data), jax.device_put(y, data)))


def test_check_nan_inf_costs_no_step_memory(make_world):
    """With the select made where Adam makes the new state, the step holds what
    it holds without the check (before: a copy of the moments, XLA's way to
    read the old moments after the in-place select overwrote them)."""
    default = fleet_live(make_world, fleet.DistributedStrategy())
    checked = fleet_live(make_world, fleet.DistributedStrategy(check_nan_inf=True))
    assert checked <= default + 1024, (checked, default)  # (the flags: a few bytes)


@pytest.mark.parametrize("stage", stages())
def test_zero_costs_no_more_than_a_hand_written_sharded_step(make_world, stage):
    """Stage 2 holds no more than the hand-written sharded step (before: the
    gathered updates and their concatenated bucket besides the parameters).
    Stage 1 holds the whole local gradient until the optimizer runs, by
    definition: its first reduce-scatter's output comes on top of it."""
    hand = hand_sharded_live()
    got = fleet_live(make_world, fleet.DistributedStrategy(
        sharding=True, sharding_configs={"stage": stage}))
    first_slices = (SIZES[0] + 1) * SIZES[1] * 4 // N  # the first bucket's slices
    assert got <= 1.02 * hand + (first_slices if stage == 1 else 0), (got, hand)


def run_calls(make_world, strategy, tx=None, calls=3, nested=False, reads=False):
    """The state after each of ``calls`` finite calls, and the outputs."""
    model, opt = setup(make_world, strategy, tx)

    def step_fn(model, opt, x, y):
        loss, grads = nnx.value_and_grad(loss_of)(model, x, y)
        if nested:  # an update the step cannot replay: selected after it
            nnx.jit(lambda m, o, g: o.update(m, g))(model, opt, grads)
        else:
            opt.update(model, grads)
        if reads:  # an output read from the new parameters
            return {"loss": loss, "w": model.layers[0].kernel[...].sum()}
        return {"loss": loss}

    step = fleet.distributed_step(step_fn)
    states, outs = [], []
    for i in range(calls):
        out = step(model, opt, *batch(i))
        states.append([np.asarray(a) for a in jax.tree.leaves(nnx.state((model, opt)))])
        outs.append([float(v) for v in jax.tree.leaves(out)])
        assert fleet.check_replicas((model, opt)) == []  # every device holds the same state
    return states, outs


def same_bits(a, b) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(u.tobytes() == v.tobytes() for u, v in zip(x, y))
        for x, y in zip(a, b))


CLIP_ADAM = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))


ZERO1 = {"sharding": True, "sharding_configs": {"stage": 1}}
ZERO2 = {"sharding": True, "sharding_configs": {"stage": 2}}


@pytest.mark.parametrize("tx, sharding, how", [
    pytest.param(None, {}, {}, marks=slow),  # (Adam in the clip-adam, zero2 and reads rows)
    (CLIP_ADAM, {}, {}),
    pytest.param(optax.sgd(1e-2, momentum=0.9), {}, {}, marks=slow),
    pytest.param(None, ZERO1, {}, marks=slow),
    (None, ZERO2, {}),
    pytest.param(None, {}, {"nested": True}, marks=slow),
    (None, {}, {"reads": True}),
], ids=["adam", "clip-adam", "momentum", "zero1", "zero2", "nested-update", "reads-new-params"])
def test_check_nan_inf_leaves_a_finite_call_bitwise_as_without(make_world, tx, sharding, how):
    """The replayed update computes the new parameters from the selected state,
    which is the new state whenever the call is finite: the same bits as a step
    without the check. An update inside a transformation of the step's own
    (``nnx.jit``) is not replayed and gets the select after the step. An output
    read from the new parameters comes from the update as traced (its first,
    unselected values, kept for it): XLA fuses that sum otherwise than without
    the check, so the output is equal up to rounding."""
    want, want_out = run_calls(make_world, fleet.DistributedStrategy(**sharding), tx, **how)
    got, got_out = run_calls(make_world, fleet.DistributedStrategy(check_nan_inf=True,
                                                                   **sharding), tx, **how)
    assert same_bits(got, want)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-6)


@pytest.mark.parametrize("sharding", [{}, ZERO2], ids=["replicated", "zero2"])
def test_a_non_finite_output_keeps_the_state_bitwise(make_world, sharding):
    """Finite gradients and a non-finite output: the replayed update's select
    takes the chain, outputs included, so the call leaves the state's bits as
    they were (the chain is known only after the update was traced)."""
    model, opt = setup(make_world, fleet.DistributedStrategy(check_nan_inf=True, **sharding))

    def step_fn(model, opt, x, y, z):
        loss, grads = nnx.value_and_grad(loss_of)(model, x, y)
        opt.update(model, grads)
        return {"loss": loss, "z": z.mean()}

    step = fleet.distributed_step(step_fn)
    x, y = batch()
    z = np.zeros((32,), np.float32)
    step(model, opt, x, y, z)
    step.wait()
    before = [np.array(a) for a in jax.tree.leaves(nnx.state((model, opt)))]
    with pytest.raises(fleet.FleetError, match="check_nan_inf: output z holds NaN or infinity "
                                               "after call 2"):
        step(model, opt, x, y, np.full((32,), np.inf, np.float32))
        step.wait()
    after = [np.asarray(a) for a in jax.tree.leaves(nnx.state((model, opt)))]
    assert same_bits([after], [before])
    assert fleet.check_replicas((model, opt)) == []
    step(model, opt, x, y, z)  # said: the next call trains
    step.wait()
    assert not same_bits([[np.asarray(a) for a in jax.tree.leaves(nnx.state((model, opt)))]],
                         [before])


@pytest.mark.parametrize("stage", stages())
def test_zero_adds_the_whole_updates_to_the_parameters(make_world, stage):
    """ZeRO applies each slice of the updates to its slice of the parameters and
    gathers the new parameters; each is the old parameter plus the whole
    update, one float32 sum (the update is made whole first, not fused into
    the sum): the bits of adding the gathered updates."""
    model, opt = setup(make_world, fleet.DistributedStrategy(
        sharding=True, sharding_configs={"stage": stage}))

    def step_fn(model, opt, x, y):
        grads = nnx.grad(loss_of)(model, x, y)
        return opt.update(model, grads)

    step = fleet.distributed_step(step_fn)
    for i in range(2):
        before = [np.array(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]
        updates = [np.asarray(u) for u in jax.tree.leaves(step(model, opt, *batch(i)))]
        after = [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]
        assert same_bits([after], [[p + u for p, u in zip(before, updates)]])
