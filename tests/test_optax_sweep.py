"""optax's optimizers, each as a single-device script would use it, against fleet.

A script fleet has not seen brings its own optimizer. Each optax optimizer here
trains a small MLP (a hidden layer, so ``muon`` finds a matrix) for five steps
of a new batch each, with ``nnx.Optimizer`` and ``nnx.value_and_grad``: on one
device (``nnx.jit``), then with fleet on 4 devices (six rows in the slow tier, the
others extended). The parameters, the optimizer's state and the losses must equal
one device's (their float reordering aside: the largest distance measured was
2.7e-7, ``muon``).
Optimizers whose update takes a value get the global one
(``value=fleet.all_reduce(loss, 'avg')``, tests/test_update_arguments.py).

The same optimizers in a Linen ``TrainState`` (``jax.value_and_grad``,
``state.apply_gradients``, ``fleet.distributed_optimizer`` of the transformation),
the module wrapped or its raw parameters (which JAX sums and fleet's optimizer
divides): ``fleet.distributed_optimizer(optax.MultiSteps(...))`` was refused as
"not an optax.GradientTransformation" (``MultiSteps`` makes one), the very
optimizer fleet's own gradient-merge refusal recommends for a ``TrainState``.
Not here: ``optax.sm3`` (refused: its state holds lists, tests/test_masked_state.py),
``optax.contrib.sophia`` (refused: tests/test_update_arguments.py) and
``optax.lookahead`` (its parameters are a fast and slow pair, not a model's).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fleet
from tests import models, tiers


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def both_kernels_adam(params):
    return jax.tree.map(lambda p: "adam" if p.ndim == 2 else "sgd", params)


OPTIMIZERS = {
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "novograd": lambda: optax.novograd(1e-2),
    "adabelief": lambda: optax.adabelief(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "fromage": lambda: optax.fromage(1e-2),
    "yogi": lambda: optax.yogi(1e-2),
    "radam": lambda: optax.radam(1e-2),
    "adan": lambda: optax.adan(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-2),
    "rprop": lambda: optax.rprop(1e-2),
    "optimistic_gradient_descent": lambda: optax.optimistic_gradient_descent(1e-2),
    "noisy_sgd": lambda: optax.noisy_sgd(1e-2, key=jax.random.key(0)),
    "clip_by_global_norm, sgd": lambda: optax.chain(optax.clip_by_global_norm(0.1),
                                                    optax.sgd(0.1)),
    "adamw, cosine schedule": lambda: optax.adamw(optax.cosine_decay_schedule(1e-2, 10)),
    "inject_hyperparams(adam)": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=1e-2),
    "MultiSteps(adam)": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "apply_if_finite(adam)": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "partition": lambda: optax.partition({"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1)},
                                         both_kernels_adam),
    "polyak_sgd": lambda: optax.polyak_sgd(0.1),
    "contrib.schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "contrib.prodigy": lambda: optax.contrib.prodigy(1.0),
    "contrib.dadapt_adamw": lambda: optax.contrib.dadapt_adamw(1.0),
    "contrib.cocob": lambda: optax.contrib.cocob(),
    "contrib.mechanize(adam)": lambda: optax.contrib.mechanize(optax.adam(1e-2)),
    "contrib.ademamix": lambda: optax.contrib.ademamix(1e-2),
    "contrib.momo": lambda: optax.contrib.momo(1e-2),
    "contrib.muon": lambda: optax.contrib.muon(1e-2),
    "contrib.sam": lambda: optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2),
    "contrib.adopt": lambda: optax.contrib.adopt(1e-2),
}
TAKES_VALUE = ("polyak_sgd", "contrib.momo")
#: The rows in the slow tier (``.ci/run``); the others are extended (20 s together).
SLOW_ROWS = ("MultiSteps(adam)", "polyak_sgd", "contrib.schedule_free_adamw", "contrib.prodigy",
             "contrib.muon", "contrib.sam")


def run(name: str, data, distributed: bool):
    model, optimizer = models.model_and_optimizer(MLP(nnx.Rngs(0)), OPTIMIZERS[name](),
                                                  wrap=distributed)

    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        if name in TAKES_VALUE:
            optimizer.update(model, grads, value=fleet.all_reduce(loss, "avg"))
        else:
            optimizer.update(model, grads)
        return loss

    losses = models.run_steps(step, model, optimizer, data, distributed)
    return (losses, models.flat_state(nnx.state(model, nnx.Param)),
            models.flat_state(nnx.state(optimizer, nnx.OptState)))


def batches() -> list:
    rng = np.random.RandomState(0)
    return [(rng.randn(16, 8).astype(np.float32), rng.randint(0, 4, 16).astype(np.int32))
            for _ in range(5)]


ROWS = [pytest.param(k, marks=tiers.slow if k in SLOW_ROWS else tiers.extended)
        for k in OPTIMIZERS]


@pytest.mark.parametrize("name", ROWS)
def test_the_optimizer_equals_one_device(make_world, name):
    data = batches()
    ref = run(name, data, distributed=False)
    make_world(4)
    got = run(name, data, distributed=True)
    d_params, d_state = models.max_diff(ref[1], got[1]), models.max_diff(ref[2], got[2])
    moved = models.max_diff(ref[1], models.flat_state(nnx.state(MLP(nnx.Rngs(0)), nnx.Param)))
    print(f"{name}: |dparams| {d_params:.1e}, |dstate| {d_state:.1e}, moved {moved:.1e}")
    assert got[0] == pytest.approx(ref[0], rel=1e-5, abs=1e-6)
    # (prodigy, D-Adaptation and mechanize start with tiny steps: 5e-6 in five)
    assert moved > 0 and d_params <= 1e-3 * moved and d_state < 1e-5


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


def run_linen(name: str, data, distributed: bool, wrapped: bool):
    module, tx = LinenMLP(), OPTIMIZERS[name]()
    if distributed:
        module = fleet.distributed_model(module) if wrapped else module
        tx = fleet.distributed_optimizer(tx)
    state = TrainState.create(apply_fn=module.apply, tx=tx,
                              params=module.init(jax.random.key(0), data[0][0][:1])["params"])

    def train(state, x, y):
        def loss_of(params):
            logits = state.apply_fn({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        if name not in TAKES_VALUE:
            return state.apply_gradients(grads=grads), loss
        updates, opt_state = state.tx.update(grads, state.opt_state, state.params,
                                             value=fleet.all_reduce(loss, "avg"))
        return state.replace(step=state.step + 1, opt_state=opt_state,
                             params=optax.apply_updates(state.params, updates)), loss

    step = fleet.distributed_step(train) if distributed else jax.jit(train)
    losses = []
    for x, y in data:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return losses, models.flat_state(state.params), models.flat_state(state.opt_state)


@pytest.mark.parametrize("wrapped", [True, False], ids=["wrapped", "raw parameters"])
@pytest.mark.parametrize("name", ROWS)
def test_the_optimizer_in_a_linen_train_state_equals_one_device(make_world, name, wrapped):
    data = batches()
    ref = run_linen(name, data, distributed=False, wrapped=wrapped)
    make_world(4)
    got = run_linen(name, data, distributed=True, wrapped=wrapped)
    assert ref[2].keys() == got[2].keys()  # (empty for fromage, sgd, polyak_sgd)
    d_params = models.max_diff(ref[1], got[1])
    d_state = models.max_diff(ref[2], got[2]) if ref[2] else 0.0
    print(f"{name}, {'wrapped' if wrapped else 'raw'}: |dparams| {d_params:.1e}, "
          f"|dstate| {d_state:.1e}")
    assert got[0] == pytest.approx(ref[0], rel=1e-5, abs=1e-6)
    assert d_params < 1e-5 and d_state < 1e-5


def test_a_distributed_multisteps_keeps_has_updated(make_world):
    """``fleet.distributed_optimizer(optax.MultiSteps(...))`` is a transformation, as
    a ``TrainState`` takes it, with the ``has_updated`` a loop asks of it."""
    make_world(2)
    tx = fleet.distributed_optimizer(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
    state = tx.init({"w": np.zeros(3, np.float32)})
    assert isinstance(tx, optax.GradientTransformation) and not tx.has_updated(state)


def test_fleet_model_prepares_a_multisteps(make_world):
    """``fleet.Model.prepare(optimizer=optax.MultiSteps(...))`` (refused as not an optax
    transformation before): the first batch accumulates, the second steps."""
    make_world(2)
    model = fleet.Model(MLP(nnx.Rngs(0)))
    model.prepare(optimizer=optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2),
                  loss=optax.softmax_cross_entropy_with_integer_labels)
    (x, y), params = batches()[0], [models.flat_state(nnx.state(model.network, nnx.Param))]
    for _ in range(2):
        model.train_batch([x], [y])
        params.append(models.flat_state(nnx.state(model.network, nnx.Param)))
    assert models.max_diff(params[0], params[1]) == 0 < models.max_diff(params[1], params[2])
