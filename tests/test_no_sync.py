"""Acceptance: k steps inside ``no_sync`` plus one normal step equal one
single-card step on the union batch, and no psum is traced inside ``no_sync``."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models, tiers
from tests.jaxpr_utils import count_primitives


def union_reference(data, tx):
    x = np.concatenate([x for x, _ in data])
    y = np.concatenate([y for _, y in data])
    return models.nnx_reference("linear", [(x, y)], tx=tx)[1]


def scaled_step(scale):
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: models.loss_of(m(x), y) * scale)(model)
        optimizer.update(model, grads)
        return loss

    return step


@pytest.mark.parametrize("k", [1, 3])
def test_no_sync_adds_the_local_gradients(make_world, k):
    """Paddle's and DDP's meaning: the synced step averages, over replicas, the SUM
    of the k + 1 local-mean gradients. With SGD(lr=1) the update is that sum."""
    data = models.batches("linear", k + 1, 8)
    reference = models.LinearNet(nnx.Rngs(0))
    grads = [nnx.grad(lambda m, x=x, y=y: models.loss_of(m(x), y))(reference) for x, y in data]
    expected = {key: value - sum(models.flat_params(nnx.to_pure_dict(g))[key] for g in grads)
                for key, value in models.flat_params(reference).items()}

    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in data[:k]:
        with model.no_sync():
            step(model, optimizer, x, y)
    step(model, optimizer, *data[k])
    diff = models.max_diff(models.flat_params(model), expected)
    print(f"no_sync k={k}: |fleet - sum of the local-mean gradients| = {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.parametrize("k", [1, 3])
# SGD sees the gradient's scale (the 1 / (k + 1) the steps divide by); Adam hardly does: slow
@pytest.mark.parametrize("tx_name", ["sgd", pytest.param("adam", marks=tiers.slow)])
def test_no_sync_steps_then_one_step_equal_the_union_step(make_world, k, tx_name):
    """With the loss divided by k + 1, the update is one step on the union batch."""
    tx = {"sgd": optax.sgd(0.5), "adam": optax.adam(models.LR)}[tx_name]
    data = models.batches("linear", k + 1, 8)
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=nnx.Param))
    step = fleet.distributed_step(scaled_step(1.0 / (k + 1)))
    before = models.flat_params(model)
    for x, y in data[:k]:
        with model.no_sync():
            step(model, optimizer, x, y)
    assert models.max_diff(models.flat_params(model), before) == 0  # nothing stepped yet
    assert int(optimizer.step.get_value()) == 0
    step(model, optimizer, *data[k])
    assert models.max_diff(models.flat_params(model), union_reference(data, tx)) < 1e-5
    assert int(optimizer.step.get_value()) == 1
    assert fleet.check_replicas(model) == []

    # The accumulator is consumed: the next call is an ordinary (scaled) step.
    x, y = data[0]
    ref = models.NNX_MODELS["linear"](nnx.Rngs(0))
    nnx.update(ref, nnx.to_pure_dict(nnx.state(model)))
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    opt_state = nnx.to_pure_dict(nnx.state(optimizer))
    assert set(opt_state.pop("grad_accum")) == {"_linear1:kernel", "_linear1:bias",
                                                "_linear2:kernel", "_linear2:bias"}
    nnx.update(ref_opt, opt_state)
    nnx.jit(scaled_step(1.0 / (k + 1)))(ref, ref_opt, x, y)
    step(model, optimizer, x, y)
    assert models.max_diff(models.flat_params(model), models.flat_params(ref)) < 1e-5


class Holder(nnx.Module):
    """A model whose optimizer holds a part of it (an actor-critic's actor, a
    fine-tuned head): ``nnx.Optimizer(holder.net, ...)``."""

    def __init__(self, rngs: nnx.Rngs):
        self.net = models.LinearNet(rngs)


def part_step(holder, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: models.loss_of(m(x), y))(holder.net)
    optimizer.update(holder.net, grads)
    return loss


def test_an_optimizer_of_a_part_of_the_model_keeps_the_local_gradients(make_world):
    """The accumulator is keyed by the parameters' names in the wrapped model
    ('net.linear1.kernel'), the optimizer's gradients by their paths below its own
    part ('linear1.kernel'): the local gradients were added under the one and
    looked up under the other, so no_sync dropped them silently (0.02 from
    optax.MultiSteps after 2 calls of gradient merge, on one device too)."""
    data = models.batches("linear", 3, 8)
    reference = models.LinearNet(nnx.Rngs(0))
    grads = [nnx.grad(lambda m, x=x, y=y: models.loss_of(m(x), y))(reference) for x, y in data]
    expected = {key: value - sum(models.flat_params(nnx.to_pure_dict(g))[key] for g in grads)
                for key, value in models.flat_params(reference).items()}

    make_world(4)
    holder = fleet.distributed_model(Holder(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(holder.net, optax.sgd(1.0),
                                                          wrt=nnx.Param))
    step = fleet.distributed_step(part_step)
    for x, y in data[:2]:
        with holder.no_sync():
            step(holder, optimizer, x, y)
    step(holder, optimizer, *data[2])
    diff = models.max_diff(models.flat_params(holder.net), expected)
    print(f"an optimizer of a part, no_sync: |fleet - sum of the local gradients| = {diff:.2e}")
    assert diff < 1e-5
    assert fleet.check_replicas(holder) == []


def test_a_plain_optimizer_under_no_sync_is_refused(make_world):
    """A plain nnx.Optimizer would step on the local gradients inside no_sync and
    leave the replicas different: the step refuses, naming the parameter."""
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = fleet.distributed_step(models.nnx_train_step)
    x, y = models.batches("linear", 1, 8)[0]
    with model.no_sync():
        with pytest.raises(fleet.FleetError, match=r"_linear1.*would hold different values.*no_sync"):
            step(model, optimizer, x, y)


def test_no_psum_is_traced_inside_no_sync(make_world):
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    x, y = models.batches("linear", 1, 8)[0]
    assert count_primitives(step.make_jaxpr(model, optimizer, x, y)) == 4  # 4 leaves, once each
    with model.no_sync():
        assert count_primitives(step.make_jaxpr(model, optimizer, x, y)) == 0
        step(model, optimizer, x, y)
        assert count_primitives(step.make_jaxpr(model, optimizer, x, y)) == 0


def test_no_sync_with_an_optax_train_state_is_refused(make_world):
    """Spec change (issue 9): the optax path cannot keep a Linen model's gradients
    local (its parameters are plain replicated state), so no_sync there raises
    instead of averaging."""
    import jax
    from flax.training.train_state import TrainState

    data = models.batches("linear", 1, 8)
    make_world(2)
    model = fleet.distributed_model(models.LinenLinearNet())
    params = model.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params,
                              tx=fleet.distributed_optimizer(optax.adam(models.LR)))
    step = fleet.distributed_step(models.linen_train_step)
    with model.no_sync(), pytest.raises(fleet.FleetUnsupportedError, match="no_sync with an optax"):
        step(state, *data[0])


def test_no_sync_cannot_be_entered_inside_a_step(make_world):
    make_world(2)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))

    @fleet.distributed_step
    def step(model, x):
        with model.no_sync():
            return model(x).mean()

    with pytest.raises(fleet.FleetError, match="enter it around the call"):
        step(model, np.ones((4, 10), np.float32))


def test_a_save_between_no_sync_steps_restores_exactly(make_world, tmp_path):
    """The accumulator is the optimizer's state: a checkpoint taken between no_sync
    steps, restored into freshly built objects, ends bitwise equal to the straight run."""
    data = models.batches("linear", 8, 8)
    make_world(4)

    def build():
        model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
        opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param))
        return model, opt, fleet.distributed_step(scaled_step(1 / 4))

    def run(model, opt, step, batches, first):
        for i, (x, y) in enumerate(batches, start=first):
            if i % 4 != 3:
                with model.no_sync():
                    step(model, opt, x, y)
            else:
                step(model, opt, x, y)

    model, opt, step = build()
    run(model, opt, step, data, 0)
    straight = models.flat_params(model)

    model, opt, step = build()
    run(model, opt, step, data[:6], 0)  # stops inside the second no_sync block
    manager = fleet.CheckpointManager(tmp_path / "ckpt")
    manager.save(6, model=model, optimizer=opt)
    manager.close()

    model, opt, step = build()  # a new process would build these
    manager = fleet.CheckpointManager(tmp_path / "ckpt")
    restored = manager.restore_latest(model=model, optimizer=opt)
    manager.close()
    assert restored.step == 6
    run(model, opt, step, data[6:], 6)
    assert models.max_diff(models.flat_params(model), straight) == 0


def two_models(seeds=(0, 1)):
    made = []
    for seed in seeds:
        model = fleet.distributed_model(models.LinearNet(nnx.Rngs(seed)))
        made += [model, fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))]
    return made


def assert_sgd_on_summed_gradients(model, reference, data):
    """``model`` equals ``reference`` (its single-device twin) after one SGD step
    on the sum of its gradients over ``data`` (a no_sync call, then a synced one)."""
    grads = [nnx.grad(lambda m, x=x, y=y: models.loss_of(m(x), y))(reference) for x, y in data]
    nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param).update(
        reference, jax.tree.map(lambda a, b: a + b, *grads))
    d = models.max_diff(models.flat_params(model), models.flat_params(reference))
    print(f"{type(reference).__name__}: |fleet - one device| = {d:.2e}")
    assert d < 1e-6


def both_step(m1, o1, m2, o2, x, y):
    return models.nnx_train_step(m1, o1, x, y) + models.nnx_train_step(m2, o2, x, y)


def test_two_models_of_one_class_accumulating_in_one_step_are_refused(make_world):
    """Two wrapped models of one class, their optimizers in one step: under no_sync
    each parameter name keeps one sum, so the second model's would mix into the
    first's (model 1 ended 0.28 away from its reference before this refusal)."""
    make_world(2)
    (x, y), = models.batches("linear", 1, 8)
    m1, o1, m2, o2 = two_models()
    step = fleet.distributed_step(both_step)
    with m1.no_sync(), m2.no_sync(), pytest.raises(
            fleet.FleetError, match=r"parameters of the same name \('_linear1.bias'.*its own "
                                    r"fleet.distributed_step"):
        step(m1, o1, m2, o2, x, y)


def test_two_models_in_their_own_steps_accumulate_as_on_one_device(make_world):
    """What the refusal says to write: one step per model. A no_sync call, then a
    synced one, equals SGD on the sum of the two calls' gradients, for each model."""
    make_world(2)
    (x0, y0), (x1, y1) = models.batches("linear", 2, 8)
    m1, o1, m2, o2 = two_models()
    steps = fleet.distributed_step(models.nnx_train_step), fleet.distributed_step(models.nnx_train_step)
    with m1.no_sync(), m2.no_sync():
        steps[0](m1, o1, x0, y0), steps[1](m2, o2, x0, y0)
    steps[0](m1, o1, x1, y1), steps[1](m2, o2, x1, y1)
    for seed, model in ((0, m1), (1, m2)):
        assert_sgd_on_summed_gradients(model, models.LinearNet(nnx.Rngs(seed)), ((x0, y0), (x1, y1)))


def test_gradient_merge_with_two_optimizers_in_one_step_is_refused(make_world):
    """Two merging optimizers in one step would divide the merged gradients once per
    optimizer (k_steps squared): refused, even for models with different names."""
    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    make_world(2, strategy)
    (x, y), = models.batches("linear", 1, 8)
    m1, o1, m2, o2 = two_models()
    step = fleet.distributed_step(both_step)
    with pytest.raises(fleet.FleetError, match="gradient_merge with 2 distributed optimizers in one step"):
        step(m1, o1, m2, o2, x, y)


def test_gradient_merge_with_one_optimizer_per_step_equals_multisteps(make_world):
    """What that refusal says to write: each optimizer in its own step. Both models
    end where optax.MultiSteps puts them on one device."""
    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    make_world(2, strategy)
    data = models.batches("linear", 4, 8)
    m1, o1, m2, o2 = two_models()
    steps = fleet.distributed_step(models.nnx_train_step), fleet.distributed_step(models.nnx_train_step)
    for x, y in data:
        steps[0](m1, o1, x, y), steps[1](m2, o2, x, y)
    for seed, model in ((0, m1), (1, m2)):
        reference = models.LinearNet(nnx.Rngs(seed))
        optimizer = nnx.Optimizer(reference, optax.MultiSteps(optax.sgd(0.1), 2), wrt=nnx.Param)
        for x, y in data:
            models.nnx_train_step(reference, optimizer, x, y)
        d = models.max_diff(models.flat_params(model), models.flat_params(reference))
        print(f"model {seed}: |fleet - optax.MultiSteps| = {d:.2e}")
        assert d < 1e-6


class Head(nnx.Module):
    """A second model whose parameters' names differ from LinearNet's."""

    def __init__(self, rngs):
        self.head = nnx.Linear(models.batches("linear", 1, 8)[0][0].shape[1], 10, rngs=rngs)

    def __call__(self, x):
        return self.head(x)


def test_two_models_with_different_names_accumulate_in_one_step_as_on_one_device(make_world):
    """Two wrapped models whose parameters' names differ, with their optimizers in
    one step: a no_sync call, then a synced one, equals SGD on the two calls'
    summed gradients for each model (what the refusal above leaves allowed)."""
    make_world(2)
    (x0, y0), (x1, y1) = models.batches("linear", 2, 8)
    made = []
    for cls, seed in ((models.LinearNet, 0), (Head, 1)):
        model = fleet.distributed_model(cls(nnx.Rngs(seed)))
        made += [model, fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))]
    m1, o1, m2, o2 = made
    step = fleet.distributed_step(both_step)
    with m1.no_sync(), m2.no_sync():
        step(m1, o1, m2, o2, x0, y0)
    step(m1, o1, m2, o2, x1, y1)
    for cls, seed, model in ((models.LinearNet, 0, m1), (Head, 1, m2)):
        assert_sgd_on_summed_gradients(model, cls(nnx.Rngs(seed)), ((x0, y0), (x1, y1)))


def _decayed_loss(m, x, y):
    """The loss plus an L2 term that reads a parameter outside the model's ``__call__``."""
    return models.loss_of(m(x), y) + 0.5 * jax.numpy.sum(m._linear1.kernel[...] ** 2)


def _decayed_step(model, optimizer, x, y):
    optimizer.update(model, nnx.grad(_decayed_loss)(model, x, y))


def test_a_parameter_read_twice_adds_what_no_sync_accumulated_once(make_world):
    """A parameter read in ``__call__`` and again outside it (weight decay) is synced
    once per trace, so the synced call adds its no_sync sum once: before, each
    read's sync added it, and ``_linear1.kernel`` ended 0.11 away from SGD on the
    summed gradients."""
    make_world(4)
    data = models.batches("linear", 2, 16)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(_decayed_step)
    with model.no_sync():
        step(model, opt, *data[0])
    step(model, opt, *data[1])
    reference = models.LinearNet(nnx.Rngs(0))
    grads = [nnx.grad(_decayed_loss)(reference, x, y) for x, y in data]
    nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param).update(
        reference, jax.tree.map(lambda a, b: a + b, *grads))
    d = models.max_diff(models.flat_params(model), models.flat_params(reference))
    print(f"no_sync, then a step reading a parameter twice: |fleet - one device| = {d:.2e}")
    assert d < 1e-6
