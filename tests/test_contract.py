"""The core contract, as one table of step shapes (issue 9, acceptance 1).

Each case runs a step shape a user writes -- Paddle's low-level path, Flax's
TrainState, the functional optax style, Flax's MNIST split, hand-written SGD,
every kind of output -- on 1, 2, 4 and 8 devices against the single-device
step on the same global batch. It either raises the documented FleetError, or
matches within 1e-5 (fp32). With Adam, it is also compared with the split-sum
reference (the single-device step whose gradient is the average of the
replicas' sub-batch gradients), which shows the float noise floor: fleet must
sit within it; both distances are printed. After every case,
``fleet.check_replicas`` finds no replica that differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fleet
from tests import models, tiers
from tests.jaxpr_utils import count_primitives

STEPS, BATCH, TOL = 8, 16, 1e-5
DEVICES = tiers.devices(1, 2, 4, 8, one=True, core=True)  # fleet's single-device path, in the default tier


def nnx_single(data, tx, n_split=None):
    """The single-device NNX script; with ``n_split`` its gradient is the split-sum one."""
    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        grads = nnx.grad(lambda m: models.loss_of(m(x), y))(model)
        optimizer.update(model, grads)

    @nnx.jit
    def split_step(model, optimizer, x, y):
        grads = models.split_mean_grad(
            lambda a, b: nnx.grad(lambda m: models.loss_of(m(a), b))(model), x, y, n_split)
        optimizer.update(model, grads)

    for x, y in data:
        (split_step if n_split else step)(model, optimizer, x, y)
    return models.flat_params(model)


def assert_matches(name, got, plain, split=None):
    """Within 1e-5 of the single-device step; with a split-sum reference, also
    within the noise floor it shows. Prints both distances."""
    d_plain = models.max_diff(got, plain)
    if split is None:
        print(f"{name}: |fleet - single device| = {d_plain:.2e}")
        assert d_plain < TOL, name
        return
    d_split, floor = models.max_diff(got, split), models.max_diff(split, plain)
    print(f"{name}: |fleet - single| = {d_plain:.2e}, |fleet - split-sum| = {d_split:.2e}, "
          f"noise floor |split-sum - single| = {floor:.2e}")
    assert d_split < TOL, name
    assert d_plain <= max(TOL, 2 * floor), name


# -- (a), (d), (g): NNX ---------------------------------------------------------------

def nnx_case(shape: str, tx):
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    if shape == "a":  # Paddle's low-level path: DataParallel + a plain optimizer
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        step = models.nnx_train_step
    elif shape == "d":  # both wrapped
        optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
        step = models.nnx_train_step
    else:  # (g) a hand-written SGD update on a wrapped model
        optimizer = None

        def step(model, _, x, y):
            grads = nnx.grad(lambda m: models.loss_of(m(x), y))(model)
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
                g = nnx.to_flat_state(grads)
                grad = dict(g)[path]
                var.set_value(var.get_value() - 0.1 * grad.get_value())

    return model, optimizer, fleet.distributed_step(step, batch_argnums=(2, 3))


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("shape, tx_name", [("a", "sgd"), ("a", "adam"), ("d", "adam"), ("g", "sgd")])
def test_nnx_step_shapes(make_world, n, shape, tx_name):
    tx = {"sgd": optax.sgd(0.1), "adam": optax.adam(models.LR)}[tx_name]
    data = models.batches("linear", STEPS, BATCH)
    make_world(n)
    model, optimizer, step = nnx_case(shape, tx)
    if shape == "d":  # each gradient leaf reduced exactly once (4 leaves, one bucket)
        assert count_primitives(step.make_jaxpr(model, optimizer, *data[0])) == 4
    for x, y in data:
        step(model, optimizer, x, y)
    got = models.flat_params(model)
    split = nnx_single(data, tx, n_split=n) if tx_name == "adam" else None
    assert_matches(f"({shape}) {tx_name} on {n}", got, nnx_single(data, tx), split)
    assert fleet.check_replicas(model) == []
    if optimizer is not None:
        assert fleet.check_replicas(optimizer) == []


def test_unwrapped_nnx_model_is_refused(make_world):
    """(c) for NNX: an optimizer with no wrapped model cannot average gradients
    that JAX already summed over replicas: the documented error."""
    make_world(4)
    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fleet.distributed_step(models.nnx_train_step)
    with pytest.raises(fleet.FleetError,
                       match=r"differentiates the 1st argument \(LinearNet\) variable '_linear1.*"
                             r"sums such gradients over the 4 replicas.*distributed_model"):
        step(model, optimizer, *models.batches("linear", 1, 8)[0])


# -- (b), (c), (e): Linen --------------------------------------------------------------

def linen_single(data, tx, n_split=None):
    module = models.LinenLinearNet()
    params = module.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=module.apply, params=params, tx=tx)

    @jax.jit
    def step(state, x, y):
        def grad(a, b):
            return jax.grad(lambda p: models.loss_of(state.apply_fn({"params": p}, a), b))(
                state.params)
        grads = models.split_mean_grad(grad, x, y, n_split) if n_split else grad(x, y)
        return state.apply_gradients(grads=grads)

    for x, y in data:
        state = step(state, x, y)
    return models.flat_params(state.params)


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("tx_name", ["sgd", "adam"])
def test_linen_train_state_with_a_plain_transformation(make_world, n, tx_name):
    """(b) a wrapped Linen module and a TrainState whose tx is plain optax."""
    tx = {"sgd": optax.sgd(0.1), "adam": optax.adam(models.LR)}[tx_name]
    data = models.batches("linear", STEPS, BATCH)
    make_world(n)
    model = fleet.distributed_model(models.LinenLinearNet())
    params = model.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    step = fleet.distributed_step(models.linen_train_step)
    for x, y in data:
        state, _ = step(state, x, y)
    split = linen_single(data, tx, n_split=n) if tx_name == "adam" else None
    assert_matches(f"(b) {tx_name} on {n}", models.flat_params(state.params),
                   linen_single(data, tx), split)
    assert fleet.check_replicas(state) == []


@pytest.mark.parametrize("n", DEVICES)
def test_functional_optax_with_no_wrapped_model(make_world, n):
    """(c) distributed_optimizer on raw parameters: JAX summed their gradients, the
    distributed optimizer divides by N."""
    data = models.batches("linear", STEPS, BATCH)
    module = models.LinenLinearNet()
    params0 = module.init(jax.random.key(0), data[0][0][:1])["params"]
    tx = optax.sgd(0.1)

    def step(params, opt_state, x, y, tx):
        grads = jax.grad(lambda p: models.loss_of(module.apply({"params": p}, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    make_world(n)
    dtx = fleet.distributed_optimizer(tx)
    params, opt_state = params0, dtx.init(params0)
    dstep = fleet.distributed_step(step, batch_argnums=(2, 3))
    for x, y in data:
        params, opt_state = dstep(params, opt_state, x, y, dtx)
    assert_matches(f"(c) on {n}", models.flat_params(params), linen_single(data, tx))
    assert fleet.check_replicas(params) == []


def test_returned_gradients_of_raw_parameters_are_refused(make_world):
    """(c) returning the summed gradients would be silently N times too big."""
    module = models.LinenLinearNet()
    x, y = models.batches("linear", 1, 8)[0]
    params = module.init(jax.random.key(0), x[:1])["params"]
    dtx = fleet.distributed_optimizer(optax.sgd(0.1))

    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: models.loss_of(module.apply({"params": p}, x), y))(params)
        updates, opt_state = dtx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), grads

    make_world(4)
    with pytest.raises(fleet.FleetError, match="returns gradients of raw parameters"):
        fleet.distributed_step(step, batch_argnums=(2, 3))(params, dtx.init(params), x, y)


@pytest.mark.parametrize("n", DEVICES)
def test_flax_mnist_split(make_world, n):
    """(e) Flax's MNIST example: apply_model returns (grads, loss, accuracy),
    update_model applies them in another step. The gradients come back with the
    parameters' shapes, equal to the single-device gradients."""
    data = models.batches("cnn", 4, BATCH)

    def apply_model(state, images, labels):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, images)
            return models.loss_of(logits, labels), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
        return grads, loss, accuracy

    def update_model(state, grads):
        return state.apply_gradients(grads=grads)

    module = models.LinenCNN()
    params = module.init(jax.random.key(0), data[0][0][:1])["params"]
    ref = TrainState.create(apply_fn=module.apply, params=params, tx=optax.sgd(0.1))
    make_world(n)
    model = fleet.distributed_model(module)
    state = TrainState.create(apply_fn=model.apply, params=model.init(
        jax.random.key(0), data[0][0][:1])["params"], tx=optax.sgd(0.1))
    f_apply, f_update = fleet.distributed_step(apply_model), fleet.distributed_step(update_model)
    j_apply, j_update = jax.jit(apply_model), jax.jit(update_model)
    for x, y in data:
        grads, loss, acc = f_apply(state, x, y)
        ref_grads, ref_loss, ref_acc = j_apply(ref, x, y)
        assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, ref_grads)
        assert_matches(f"(e) grads on {n}", models.flat_params(grads), models.flat_params(ref_grads))
        assert abs(float(loss) - float(ref_loss)) < TOL and abs(float(acc) - float(ref_acc)) < TOL
        state, ref = f_update(state, grads), j_update(ref, ref_grads)
    assert_matches(f"(e) params on {n}", models.flat_params(state.params),
                   models.flat_params(ref.params))
    assert fleet.check_replicas(state) == []


# -- (f): outputs -------------------------------------------------------------------

@pytest.mark.parametrize("n", DEVICES)
def test_outputs(make_world, n):
    """(f) a mean loss, a float sum declared as a sum, an int count, per-example
    logits, a metrics dict and the aux output of has_aux: all as on one device."""
    x, y = models.batches("cnn", 1, BATCH)[0]

    def evaluate(model, x, y):
        def loss_fn(m):
            logits = m(x)
            return models.loss_of(logits, y), logits  # has_aux

        (loss, logits), _ = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        correct = jnp.argmax(logits, -1) == y
        return (loss, correct.sum().astype(jnp.float32), correct.sum(), logits,
                {"accuracy": correct.mean(), "max_logit": logits.max(axis=-1)})

    reference = nnx.jit(evaluate)(models.CNN(nnx.Rngs(0)), x, y)
    make_world(n)
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    got = fleet.distributed_step(evaluate, out_reduce=(None, "sum", None, None, None))(model, x, y)
    assert jax.tree.structure(got) == jax.tree.structure(reference)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference)):
        assert np.shape(a) == np.shape(b) and np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert fleet.check_replicas(model) == []


def test_float_sum_without_a_declaration_is_the_sum(make_world):
    """A float count needs no declaration: fleet reads from the traced step that it
    is a sum over the batch rows (fleet.semantics._outputs; it was the mean of the replicas'
    counts, 2.0, before issue 33)."""
    make_world(4)
    x = np.ones((8, 10), np.float32)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    count = fleet.distributed_step(lambda m, x: (m(x) < 1e9).sum().astype(jnp.float32))(model, x)
    assert float(count) == 8.0  # the 4 replicas' 2 rows each
    declared = fleet.distributed_step(lambda m, x: (m(x) < 1e9).sum().astype(jnp.float32),
                                      out_reduce="sum")(model, x)
    assert float(declared) == 8.0


def test_output_fleet_cannot_combine_needs_a_declaration(make_world):
    make_world(4)
    x = np.ones((8, 10), np.float32)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    per_replica_stats = fleet.distributed_step(lambda m, x: m(x).T @ m(x))
    with pytest.raises(fleet.FleetError, match=r"output .*differs across replicas.*out_reduce"):
        per_replica_stats(model, x)
    summed = fleet.distributed_step(lambda m, x: m(x).T @ m(x), out_reduce="sum")(model, x)
    single = models.LinearNet(nnx.Rngs(0))(x)
    np.testing.assert_allclose(np.asarray(summed), np.asarray(single.T @ single), rtol=1e-5)
    with pytest.raises(fleet.FleetConfigError, match="out_reduce value 'avg' is not one of"):
        fleet.distributed_step(lambda m, x: m(x).mean(), out_reduce="avg")(model, x)


def _l2_step(model, optimizer, x, y):
    def loss_fn(m):
        penalty = sum((p ** 2).sum() for p in jax.tree.leaves(nnx.state(m, nnx.Param)))
        return ((m(x) - y) ** 2).mean() + 1e-3 * penalty

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _own_psum_step(model, optimizer, x, y):
    loss = models.nnx_train_step(model, optimizer, x, y)
    return jax.lax.psum(loss, "data")


@pytest.mark.parametrize("fn, match", [
    (_l2_step, r"differentiates the 1st argument \(DataParallel\[LinearNet\]\) variable "
               r"'_linear1\.bias'.* through a read outside the wrapped model's call .*"
               r"optax\.add_decayed_weights"),
    (_own_psum_step, r"the step sums over the 4 replicas itself \(a jax\.lax\.psum or pmean "
                     r"of its own\): fleet already averages .* fleet\.all_reduce"),
])
def test_sums_over_replicas_name_the_leaf_and_the_fix(make_world, fn, match):
    """Issue 21: an L2 penalty read from the parameters inside the loss names the
    leaves and the fix; a psum of the step's own says fleet already averages."""
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    with pytest.raises(fleet.FleetError, match=match) as info:
        fleet.distributed_step(fn)(model, optimizer, *models.batches("linear", 1, 8)[0])
    assert "which is not a wrapped model's parameter" not in str(info.value)


def test_a_jitted_linen_init_gives_the_same_replicated_variables(make_world):
    """Issue 21: Flax's examples write jax.jit(model.init); on a wrapped Linen
    module it gives init's values, replicated on the mesh, equal everywhere."""
    world = make_world(4)
    module = fleet.distributed_model(models.LinenLinearNet())
    x = models.batches("linear", 1, 8)[0][0][:1]
    plain = module.init(jax.random.key(0), x)
    jitted = jax.jit(module.init)(jax.random.key(0), x)
    assert jax.tree.structure(plain) == jax.tree.structure(jitted)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.is_equivalent_to(world.replicated, b.ndim)
    assert fleet.check_replicas(jitted) == []


def _pmap_pmean_step(model, optimizer, x, y):
    loss = models.nnx_train_step(model, optimizer, x, y)
    return jax.lax.pmean(loss, axis_name="batch")  # kept from a jax.pmap script


def test_a_collective_over_a_pmap_axis_name_says_what_to_do(make_world):
    """Issue 21: JAX's bare AssertionError for axis_name='batch' becomes a FleetError
    naming fleet's axis and saying fleet already averages; issue 33: it names the
    axis and the line that called the collective, raised from the user's frames
    (no JAX exception chained: tests/test_scan.py)."""
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    with pytest.raises(fleet.FleetError, match=r"collective over an axis other than fleet's "
                                               r"'data'.*axis_name='batch'.*fleet already "
                                               r"averages the loss.*fleet\.DATA_AXIS") as info:
        fleet.distributed_step(_pmap_pmean_step)(model, optimizer,
                                                 *models.batches("linear", 1, 8)[0])
    assert info.value.__cause__ is None
    assert fleet.DATA_AXIS == "data"
