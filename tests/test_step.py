"""distributed_step: compiles once per shape, tells arguments and outputs apart,
and the Paddle-style helpers reduce exactly once."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models
from tests.jaxpr_utils import count_primitives


@pytest.fixture
def setup(make_world):
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    return model, optimizer


def test_compiles_once_per_input_shape(setup):
    model, optimizer = setup
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in models.batches("linear", 3, 8):
        step(model, optimizer, x, y)
    assert step.trace_count == 1
    for x, y in models.batches("linear", 3, 16):
        step(model, optimizer, x, y)
    assert step.trace_count == 2


def test_python_scalars_are_traced_not_static(setup):
    model, _ = setup

    @fleet.distributed_step
    def scaled(model, x, scale):
        return (model(x) * scale).mean()

    x = np.ones((4, 10), np.float32)
    a, b = float(scaled(model, x, 1.0)), float(scaled(model, x, 3.0))
    assert scaled.trace_count == 1
    np.testing.assert_allclose(b, 3 * a, rtol=1e-6)


def test_outputs_mean_sum_and_per_example(setup):
    model, _ = setup
    x = np.random.RandomState(0).randn(8, 10).astype(np.float32)
    single = np.asarray(models.LinearNet(nnx.Rngs(0))(x))

    @fleet.distributed_step
    def evaluate(model, x):
        out = model(x)
        return {"mean": out.mean(), "count": (out > 0).sum(), "per_example": out}

    result = evaluate(model, x)
    np.testing.assert_allclose(float(result["mean"]), single.mean(), rtol=1e-6)
    assert int(result["count"]) == int((single > 0).sum())
    assert result["per_example"].shape == (8, 1)
    np.testing.assert_allclose(np.asarray(result["per_example"]), single, rtol=1e-6)


def test_keyword_arguments_and_batch_dicts(setup):
    model, optimizer = setup

    @fleet.distributed_step
    def step(model, optimizer, batch, *, weight):
        loss, grads = nnx.value_and_grad(
            lambda m: weight * models.loss_of(m(batch["x"]), batch["y"]))(model)
        optimizer.update(model, grads)
        return loss

    x, y = models.batches("linear", 1, 8)[0]
    ref = models.LinearNet(nnx.Rngs(0))
    ref_loss = float(models.loss_of(ref(x), y))
    assert abs(float(step(model, optimizer, {"x": x, "y": y}, weight=2.0)) - 2 * ref_loss) < 1e-5


def test_raw_parameter_pytrees_with_batch_argnums(make_world):
    """The functional optax style: params and opt_state are state, said by batch_argnums."""
    make_world(4)
    data = models.batches("linear", 5, 8)
    module = models.LinenLinearNet()
    params0 = module.init(jax.random.key(0), data[0][0][:1])["params"]

    def step(params, opt_state, x, y, tx):
        loss, grads = jax.value_and_grad(lambda p: models.loss_of(module.apply({"params": p}, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tx = optax.adam(models.LR)
    ref_params, ref_state = params0, tx.init(params0)
    for x, y in data:
        ref_params, ref_state, _ = jax.jit(step, static_argnums=4)(ref_params, ref_state, x, y, tx)

    dtx = fleet.distributed_optimizer(tx)
    params, opt_state = params0, dtx.init(params0)
    dstep = fleet.distributed_step(step, batch_argnums=(2, 3))
    for x, y in data:
        params, opt_state, loss = dstep(params, opt_state, x, y, dtx)
    assert params["Dense_0"]["kernel"].sharding.is_fully_replicated
    assert models.max_diff(models.flat_params(params), models.flat_params(ref_params)) < 1e-5


@pytest.mark.parametrize("how", ["fused_allreduce_gradients", "apply_collective_grads"])
def test_hand_reduced_gradients_are_not_reduced_again(make_world, how):
    """The seeds' recipe: reduce by hand, then step; the optimizer must not reduce
    (or scale) again. SGD makes any double reduction visible."""
    data = models.batches("linear", 3, 8)
    _, ref_params = models.nnx_reference("linear", data, tx=optax.sgd(0.1))
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))

    @fleet.distributed_step
    def step(model, optimizer, x, y):
        loss = lambda m: model.scale_loss(models.loss_of(m(x), y))  # noqa: E731
        grads = nnx.grad(loss)(model)
        if how == "fused_allreduce_gradients":
            grads = fleet.fused_allreduce_gradients(grads)
        else:
            grads = model.apply_collective_grads(grads)
        optimizer.update(model, grads)

    # Averaging twice would not change the values, so count the collectives: each
    # of the 4 gradient leaves (one bucket, one psum of its list) reduced once.
    assert count_primitives(step.make_jaxpr(model, optimizer, *data[0])) == 4
    for x, y in data:
        step(model, optimizer, x, y)
    assert models.max_diff(models.flat_params(model), ref_params) < 1e-5


def test_collectives_inside_a_step(make_world):
    make_world(4)

    @fleet.distributed_step
    def collect(x):
        me = x[0, 0]  # replica r holds r
        return {
            "sum": fleet.all_reduce(me)[None],
            "max": fleet.all_reduce(me, op="max")[None],
            "avg": fleet.all_reduce(me, op="avg")[None],
            "from_2": fleet.broadcast(me, src=2)[None],
            "gathered": fleet.all_gather(me)[None],
        }

    # Each result is the same on every replica (invariant), so it comes back once.
    out = collect(np.arange(4, dtype=np.float32).reshape(4, 1))
    np.testing.assert_array_equal(np.asarray(out["sum"]), [6])
    np.testing.assert_array_equal(np.asarray(out["max"]), [3])
    np.testing.assert_array_equal(np.asarray(out["avg"]), [1.5])
    np.testing.assert_array_equal(np.asarray(out["from_2"]), [2])
    np.testing.assert_array_equal(np.asarray(out["gathered"]), [[0, 1, 2, 3]])


def test_collectives_outside_a_step_with_one_process(make_world):
    make_world(4)
    x = jnp.arange(3.0)
    assert fleet.all_reduce(x) is x
    assert fleet.broadcast(x) is x
    np.testing.assert_array_equal(fleet.all_gather(x), np.arange(3.0)[None])
    fleet.barrier()
    fleet.barrier_worker()
    assert (fleet.worker_index(), fleet.worker_num(), fleet.is_first_worker()) == (0, 1, True)
    assert (fleet.num_replicas(), fleet.num_local_replicas()) == (4, 4)
    with pytest.raises(fleet.FleetConfigError, match="op='mean' is not one of"):
        fleet.all_reduce(x, op="mean")


def test_arrays_committed_elsewhere_are_placed_on_the_mesh(setup):
    """A replicated argument and a tree argument committed to other devices than
    the mesh's: jit refuses them, and the step places them on the mesh after
    checking their shardings; an error of the step itself still names itself."""
    model, _ = setup
    devices = jax.devices()

    @fleet.distributed_step
    def step(model, extra, x, scale):
        return (model(x) * scale).mean() + extra["bias"]

    x, _ = models.batches("linear", 1, 8)[0]
    elsewhere = jax.sharding.NamedSharding(  # devices 4..7: outside the 4-device mesh
        jax.sharding.Mesh(np.array(devices[4:8]), ("other",)), jax.P())
    scale = jax.device_put(jnp.float32(2.0), elsewhere)
    extra = {"bias": jax.device_put(jnp.float32(3.0), elsewhere), "steps": 0}
    expected = float((model(x) * 2.0).mean() + 3.0)
    assert float(step(model, extra, x, scale)) == pytest.approx(expected, rel=1e-6)

    @fleet.distributed_step
    def broken(model, extra, x, scale):
        raise ValueError("the step's own error")

    with pytest.raises(fleet.FleetError, match="ValueError: the step's own error"):
        broken(model, extra, x, scale)


class WithPlainDict(nnx.Module):
    """A common NNX pattern (issue 21): a plain dict attribute, which nnx.jit takes."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(10, 1, rngs=rngs)
        self.config = {"scale": 2.0, "names": ["a", "b"]}

    def __call__(self, x):
        return self.linear(x) * self.config["scale"]


def test_a_model_with_a_plain_dict_attribute_trains(make_world):
    """Its graph cannot be hashed (the dict); the step still compiles once and
    trains the single-device model."""
    data = models.batches("linear", 4, 16)
    reference = WithPlainDict(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    ref_step = nnx.jit(models.nnx_train_step)
    want = [float(ref_step(reference, ref_opt, x, y)) for x, y in data]

    make_world(4)
    model = fleet.distributed_model(WithPlainDict(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    got = [float(step(model, optimizer, x, y)) for x, y in data]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert models.max_diff(models.flat_params(model), models.flat_params(reference)) < 1e-6
    assert step.trace_count == 1
