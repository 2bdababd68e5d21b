"""NNX objects and variables passed to the step inside other arguments.

An actor-critic script on one device passes its two optimizers as one argument,
``step(agent, (actor_opt, critic_opt), batch)``; ``nnx.jit`` updates objects
wherever they sit. fleet updates the NNX objects passed as arguments themselves
and took a tuple's arrays as values: each optimizer's state was dropped after
every step (Adam restarted each time), silently, 0.04 in the parameters after 4
steps on 4 devices and on one. A bare ``nnx.Variable`` argument (a counter)
lost its writes alike. A write into a pytree argument's variable is now refused,
naming the argument, the variable and the fix; a read (a teacher's
``nnx.state``) is fine, and the fixes train as on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models


class Net(nnx.Module):
    def __init__(self, outputs: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(4, 16, rngs=rngs)
        self.out = nnx.Linear(16, outputs, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.hidden(x)))


class ActorCritic(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.actor = Net(2, rngs)
        self.critic = Net(1, rngs)


def update(agent, actor_opt, critic_opt, s, a, ret):
    """One advantage actor-critic update."""
    value_loss, grads = nnx.value_and_grad(lambda c: ((c(s)[:, 0] - ret) ** 2).mean())(
        agent.critic)
    advantage = jax.lax.stop_gradient(ret - agent.critic(s)[:, 0])

    def policy_loss(actor):
        log_p = jax.nn.log_softmax(actor(s))[jnp.arange(s.shape[0]), a]
        return -(log_p * advantage).mean()

    actor_loss, actor_grads = nnx.value_and_grad(policy_loss)(agent.actor)
    critic_opt.update(agent.critic, grads)
    actor_opt.update(agent.actor, actor_grads)
    return value_loss, actor_loss


def paired_step(agent, optimizers, s, a, ret):  # the optimizers as one argument
    return update(agent, *optimizers, s, a, ret)


def make():
    agent = ActorCritic(nnx.Rngs(0))
    return agent, [nnx.Optimizer(agent.actor, optax.adam(1e-2), wrt=nnx.Param),
                   nnx.Optimizer(agent.critic, optax.adam(1e-2), wrt=nnx.Param)]


def rollouts(steps: int = 4):
    rng = np.random.RandomState(0)
    return [(rng.randn(16, 4).astype(np.float32), rng.randint(0, 2, 16).astype(np.int32),
             rng.randn(16).astype(np.float32)) for _ in range(steps)]


def one_device():
    agent, (actor_opt, critic_opt) = make()
    step = nnx.jit(update)
    losses = [step(agent, actor_opt, critic_opt, *b) for b in rollouts()]
    return agent, losses


def test_optimizers_in_a_tuple_are_refused_naming_the_argument(make_world):
    make_world(4)
    agent, optimizers = make()
    agent = fleet.distributed_model(agent)
    optimizers = tuple(fleet.distributed_optimizer(o) for o in optimizers)
    step = fleet.distributed_step(paired_step)
    with pytest.raises(fleet.FleetError, match=r"writes into the nnx\.\w+ at \[0\..*\] of the "
                       r"2nd argument, a tuple.*Pass each object as its own argument"):
        step(agent, optimizers, *rollouts(1)[0])


@pytest.mark.parametrize("form", ["arguments", "nnx.List"])
def test_the_fixes_train_as_on_one_device(make_world, form):
    ref, ref_losses = one_device()
    make_world(4)
    agent, optimizers = make()
    agent = fleet.distributed_model(agent)
    optimizers = [fleet.distributed_optimizer(o) for o in optimizers]
    if form == "arguments":
        step = fleet.distributed_step(update)
        losses = [step(agent, *optimizers, *b) for b in rollouts()]
    else:
        step = fleet.distributed_step(paired_step)
        losses = [step(agent, nnx.List(optimizers), *b) for b in rollouts()]
    diff = models.max_diff(models.flat_params(agent), models.flat_params(ref))
    print(f"actor-critic, optimizers as {form}: |fleet - one device| = {diff:.2e}")
    assert diff < 1e-6
    np.testing.assert_allclose(np.array(losses), np.array(ref_losses), rtol=1e-5, atol=1e-7)
    assert int(optimizers[0].step[...]) == 4
    assert fleet.check_replicas(agent) == []


def counted(model, optimizer, count, x, y):
    loss = models.nnx_train_step(model, optimizer, x, y)
    count[...] += 1
    return loss


def test_a_variable_argument_written_in_the_step_is_refused(make_world):
    x, y = models.batches("linear", 1, 8)[0]
    count = nnx.Variable(jnp.zeros((), jnp.int32))
    model = models.LinearNet(nnx.Rngs(0))
    nnx.jit(counted)(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), count, x, y)
    assert int(count[...]) == 1  # what one device does

    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(counted)
    with pytest.raises(fleet.FleetError, match=r"writes into the 3rd argument, an nnx\.Variable.*"
                       r"nnx\.Module \(an attribute of the model\)"):
        step(model, optimizer, nnx.Variable(jnp.zeros((), jnp.int32)), x, y)


def distill(model, optimizer, teacher_state, x):
    teacher = nnx.merge(nnx.graphdef(models.LinearNet(nnx.Rngs(1))), teacher_state)
    target = jax.lax.stop_gradient(teacher(x))
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - target) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss


def test_a_state_argument_that_is_only_read_trains_as_on_one_device(make_world):
    teacher = nnx.state(models.LinearNet(nnx.Rngs(5)))
    batches = [x for x, _ in models.batches("linear", 3, 8)]
    ref = models.LinearNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    ref_losses = [float(nnx.jit(distill)(ref, ref_opt, teacher, x)) for x in batches]

    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2),
                                                          wrt=nnx.Param))
    step = fleet.distributed_step(distill)
    losses = [float(step(model, optimizer, teacher, x)) for x in batches]
    diff = models.max_diff(models.flat_params(model), models.flat_params(ref))
    print(f"a teacher's state as an argument: |fleet - one device| = {diff:.2e}")
    assert diff < 1e-6
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)


def configured(model, config, x, y):
    name, optimizer = config
    return models.nnx_train_step(model, optimizer, x, y)


def test_an_object_in_a_static_argument_is_refused(make_world):
    """A tuple with a string and an optimizer holds values that are not arrays, so
    it is a static value of the step: the optimizer's arrays would be constants of
    the compiled program (stale once they change), and its update failed with
    Flax's raw "Cannot mutate OptArray from a different trace level"."""
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    step = fleet.distributed_step(configured)
    x, y = models.batches("linear", 1, 8)[0]
    with pytest.raises(fleet.FleetError, match=r"the 2nd argument, a tuple, holds an NNX object "
                       r"\(DistributedOptimizer at \[1\]\).*static value.*its own argument"):
        step(model, ("adam", optimizer), x, y)
