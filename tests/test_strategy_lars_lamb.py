"""``strategy.lars`` / ``strategy.lamb``: the optimizer swap, against optax built by hand.

Paddle swaps a Momentum optimizer for LARS and an Adam for LAMB, keeping the
learning rate. Each case trains 10 steps with the swapped transformation and
with ``optax.lars`` / ``optax.lamb`` written out by hand from the mapped configs
(weight-decay masks written out), and asserts the parameters agree within 1e-6;
the exclusion list is shown to change the result. Through fleet (``fleet.init``
with the strategy, ``fleet.distributed_optimizer``, a 4-device
``fleet.distributed_step``), the result matches single-device ``optax.lars`` /
``optax.lamb`` on the same global batch within 1e-5, and is far from the run
without the exclusions and from the unswapped optimizer. Every refusal is tested
with the fix its message names.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fleet
from fleet.sections._hparams import Adam, Momentum, hparams_of
from fleet.sections._large_batch import swap_optimizer_state, swap_tx
from tests import models
from tests.tiers import slow

STEPS, BATCH, TOL = 10, 16, 1e-6
BIAS_OFF = {"linear1": {"kernel": True, "bias": False}, "linear2": {"kernel": True, "bias": False}}


def strategy(section: str | None = None, **configs) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    if section:
        setattr(s, section, True)
        setattr(s, f"{section}_configs", configs)
    return s


# -- The swapped transformation against hand-built optax, on a functional MLP ----------

def init_params() -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "linear1": {"kernel": jax.random.normal(k1, (10, 10)) * 0.3, "bias": jnp.full((10,), 0.1)},
        "linear2": {"kernel": jax.random.normal(k2, (10, 1)) * 0.3, "bias": jnp.full((1,), -0.2)},
    }


def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["linear1"]["kernel"] + p["linear1"]["bias"])
    return ((h @ p["linear2"]["kernel"] + p["linear2"]["bias"] - y) ** 2).mean()


def train(tx) -> dict:
    params = init_params()
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for x, y in models.batches("linear", STEPS, BATCH):
        params, state = step(params, state, x, y)
    return models.flat_params(params)


SCHEDULE = optax.exponential_decay(0.1, transition_steps=3, decay_rate=0.5)

# name -> (inner optimizer, section, configs, the hand-built optax reference)
SWAPS = {
    "lars defaults": (
        lambda: Momentum(0.1), "lars", {},
        lambda: optax.lars(0.1, weight_decay=5e-4, trust_coefficient=1e-3, eps=0.0, momentum=0.9)),
    "lars configs, nesterov, bias excluded": (
        lambda: Momentum(0.05, momentum=0.8, use_nesterov=True), "lars",
        dict(lars_coeff=0.02, lars_weight_decay=0.05, epsilon=1e-6, exclude_from_weight_decay=["bias"]),
        lambda: optax.lars(0.05, weight_decay=0.05, weight_decay_mask=BIAS_OFF, trust_coefficient=0.02,
                           eps=1e-6, momentum=0.8, nesterov=True)),
    "lars, a schedule": (
        lambda: Momentum(SCHEDULE), "lars", dict(lars_coeff=0.01),
        lambda: optax.lars(SCHEDULE, weight_decay=5e-4, trust_coefficient=0.01, momentum=0.9)),
    "lars from inject_hyperparams(sgd)": (
        lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9), "lars",
        dict(exclude_from_weight_decay=["linear2"]),
        lambda: optax.lars(0.1, weight_decay=5e-4, trust_coefficient=1e-3, momentum=0.9,
                           weight_decay_mask={"linear1": {"kernel": True, "bias": True},
                                              "linear2": {"kernel": False, "bias": False}})),
    "lamb defaults": (
        lambda: Adam(1e-2), "lamb", {},
        lambda: optax.lamb(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)),
    "lamb betas, bias excluded": (
        lambda: Adam(1e-2, beta1=0.8, beta2=0.99, epsilon=1e-6), "lamb",
        dict(lamb_weight_decay=0.2, exclude_from_weight_decay=["bias"]),
        lambda: optax.lamb(1e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.2, mask=BIAS_OFF)),
    "lamb from inject_hyperparams(adam)": (
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.85), "lamb",
        dict(lamb_weight_decay=0.1, exclude_from_weight_decay=["bias"]),
        lambda: optax.lamb(1e-2, b1=0.85, eps=1e-8, weight_decay=0.1, mask=BIAS_OFF)),
}


@pytest.mark.parametrize("name", list(SWAPS))
def test_swap_equals_hand_built_optax(name):
    inner, section, configs, reference = SWAPS[name]
    tx = swap_tx(inner(), strategy(section, **configs))
    got, want = train(tx), train(reference())
    d = models.max_diff(got, want)
    moved = models.max_diff(got, models.flat_params(init_params()))
    print(f"{name}: |swapped - optax by hand| = {d:.2e} (parameters moved {moved:.2e})")
    assert d < TOL, name
    assert moved > 1e-3, name  # it trained
    assert hparams_of(tx).kind == section
    assert swap_tx(tx, strategy(section, **configs)) is tx  # swapping twice changes nothing


@pytest.mark.parametrize("section, inner", [("lars", lambda: Momentum(0.1)),
                                            ("lamb", lambda: Adam(1e-2))])
def test_exclude_from_weight_decay_changes_the_result(section, inner):
    decay = {"lars": dict(lars_weight_decay=0.1, lars_coeff=0.01), "lamb": dict(lamb_weight_decay=0.2)}
    plain = train(swap_tx(inner(), strategy(section, **decay[section])))
    excluded = train(swap_tx(inner(), strategy(section, **decay[section],
                                               exclude_from_weight_decay=["bias"])))
    d_bias = max(models.max_diff({k: v}, {k: excluded[k]}) for k, v in plain.items() if "bias" in k)
    d_kernel = max(models.max_diff({k: v}, {k: excluded[k]}) for k, v in plain.items() if "kernel" in k)
    print(f"{section}: excluding 'bias' moves the biases by {d_bias:.2e}, the kernels by {d_kernel:.2e}")
    assert d_bias > 1e-4


def test_off_returns_the_same_object():
    tx = optax.adam(1e-3)
    assert swap_tx(tx, strategy()) is tx


def test_constructors_are_the_optax_ones():
    params = init_params()
    grads = jax.grad(loss_fn)(params, *models.batches("linear", 1, BATCH)[0])
    for ours, theirs in [(Momentum(0.1, 0.8, use_nesterov=True), optax.sgd(0.1, 0.8, nesterov=True)),
                         (Adam(1e-3, 0.8, 0.99, 1e-6), optax.adam(1e-3, 0.8, 0.99, 1e-6))]:
        a, _ = ours.update(grads, ours.init(params), params)
        b, _ = theirs.update(grads, theirs.init(params), params)
        assert models.max_diff(models.flat_params(a), models.flat_params(b)) == 0.0


# -- An nnx.Optimizer whose state is swapped ---------------------------------------------

def keep_bias(params):
    """The hand-written NNX mask: no weight decay on biases."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "bias" not in jax.tree_util.keystr(path), params,
        is_leaf=lambda x: isinstance(x, nnx.Variable))


# name -> (inner optimizer, section, configs, the hand-built optax reference)
NNX_SWAPS = {
    "Momentum -> lars": (
        lambda: Momentum(0.1), "lars", dict(lars_weight_decay=0.01, exclude_from_weight_decay=["bias"]),
        lambda: optax.lars(0.1, weight_decay=0.01, weight_decay_mask=keep_bias, momentum=0.9)),
    "Adam -> lamb": (
        lambda: Adam(1e-2), "lamb", dict(exclude_from_weight_decay=["bias"]),
        lambda: optax.lamb(1e-2, eps=1e-8, weight_decay=0.01, mask=keep_bias)),
    "inject_hyperparams(adam) -> lamb": (
        lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), "lamb", {},
        lambda: optax.inject_hyperparams(optax.lamb)(learning_rate=1e-2, eps=1e-8, weight_decay=0.01)),
}


def nnx_train(optimizer, model):
    step = nnx.jit(models.nnx_train_step)
    for x, y in models.batches("linear", STEPS, BATCH):
        step(model, optimizer, x, y)
    return models.flat_params(model)


@pytest.mark.parametrize("name", list(NNX_SWAPS))
def test_swapped_nnx_optimizer_equals_one_built_with_optax(name):
    inner, section, configs, reference = NNX_SWAPS[name]
    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, inner(), wrt=nnx.Param)
    swap_optimizer_state(optimizer, swap_tx(optimizer.tx, strategy(section, **configs)))
    ref_model = models.LinearNet(nnx.Rngs(0))
    ref = nnx.Optimizer(ref_model, reference(), wrt=nnx.Param)
    assert jax.tree.structure(optimizer.opt_state) == jax.tree.structure(ref.opt_state)
    got, want = nnx_train(optimizer, model), nnx_train(ref, ref_model)
    d = models.max_diff(got, want)
    d_state = max(float(np.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(nnx.state(optimizer.opt_state)), jax.tree.leaves(nnx.state(ref.opt_state))))
    print(f"{name}: |swapped nnx.Optimizer - optax by hand| = {d:.2e}, optimizer state {d_state:.2e}")
    assert d < TOL and d_state < TOL, name
    assert int(optimizer.step.get_value()) == STEPS


def test_swapped_injected_optimizer_keeps_its_learning_rate_variable():
    """LRScheduler sets ``hyperparams['learning_rate']``: the swapped state keeps one."""
    from fleet.hapi._callbacks import learning_rate_variables

    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.inject_hyperparams(optax.sgd)(learning_rate=0.1,
                                                                         momentum=0.9), wrt=nnx.Param)
    swap_optimizer_state(optimizer, swap_tx(optimizer.tx, strategy("lars")))
    [lr] = learning_rate_variables(optimizer)
    assert float(lr.get_value()) == pytest.approx(0.1)


# -- Refusals ---------------------------------------------------------------------------

def _both_on() -> fleet.DistributedStrategy:
    s = strategy("lars")
    s.lamb = True
    return s


# name -> (inner optimizer, strategy, what the message must say)
ERRORS = {
    "Momentum for lamb": (
        lambda: Momentum(0.1), lambda: strategy("lamb"),
        r"strategy.lamb replaces an Adam optimizer with LAMB.*got fleet.optimizer.Momentum\("
        r"learning_rate=0.1, momentum=0.9\). Build it with fleet.optimizer.Adam\(learning_rate=1e-3\)"),
    "Adam for lars": (
        lambda: Adam(1e-3), lambda: strategy("lars"),
        r"strategy.lars replaces a Momentum optimizer with LARS \(as Paddle requires Momentum\); "
        r"got fleet.optimizer.Adam\(.*Build it with fleet.optimizer.Momentum\(learning_rate=0.1, "
        r"momentum=0.9\)"),
    "plain optax.adam for lamb": (
        lambda: optax.adam(1e-3), lambda: strategy("lamb"),
        r"cannot read.*learning rate.*Build it with fleet.optimizer.Adam\(learning_rate=1e-3\) \(or "
        r"optax.inject_hyperparams\(optax.adam\)"),
    "plain optax.sgd for lars": (
        lambda: optax.sgd(0.1, 0.9), lambda: strategy("lars"),
        r"cannot read.*Build it with fleet.optimizer.Momentum"),
    "injected sgd without momentum for lars": (
        lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), lambda: strategy("lars"),
        r"got optax.inject_hyperparams\(optax.sgd\)\(learning_rate=0.1\) \(no momentum\)"),
    "injected sgd with a scheduled rate": (
        lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE, momentum=0.9),
        lambda: strategy("lars"), r"cannot read.*fleet.optimizer.Momentum"),
    "injected nadam for lamb": (
        lambda: optax.inject_hyperparams(optax.nadam)(learning_rate=1e-3), lambda: strategy("lamb"),
        r"cannot read.*fleet.optimizer.Adam"),
    "injected amsgrad for lamb": (
        lambda: optax.inject_hyperparams(optax.amsgrad)(learning_rate=1e-3), lambda: strategy("lamb"),
        r"cannot read.*fleet.optimizer.Adam"),
    "both on": (
        lambda: Momentum(0.1), _both_on,
        r"strategy.lars and strategy.lamb are both on.*turn one of them off"),
    "lars_coeff 0": (
        lambda: Momentum(0.1), lambda: strategy("lars", lars_coeff=0.0),
        r"strategy.lars_configs.lars_coeff must be a finite number > 0, got 0.0"),
    "negative lars weight decay": (
        lambda: Momentum(0.1), lambda: strategy("lars", lars_weight_decay=-1e-4),
        r"strategy.lars_configs.lars_weight_decay must be a finite number >= 0"),
    "negative lars epsilon": (
        lambda: Momentum(0.1), lambda: strategy("lars", epsilon=-1.0),
        r"strategy.lars_configs.epsilon must be a finite number >= 0"),
    "negative lamb weight decay": (
        lambda: Adam(1e-3), lambda: strategy("lamb", lamb_weight_decay=-0.01),
        r"strategy.lamb_configs.lamb_weight_decay must be a finite number >= 0"),
    "exclude holds a number": (
        lambda: Adam(1e-3), lambda: strategy("lamb", exclude_from_weight_decay=["bias", 3]),
        r"exclude_from_weight_decay holds 3; each entry must be a non-empty string"),
    "exclude holds an empty name": (
        lambda: Momentum(0.1), lambda: strategy("lars", exclude_from_weight_decay=[""]),
        r"exclude_from_weight_decay holds ''; each entry must be a non-empty string"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_refusals_name_the_fix(name):
    inner, make_strategy, match = ERRORS[name]
    with pytest.raises(fleet.FleetConfigError, match=match):
        swap_tx(inner(), make_strategy())


@pytest.mark.parametrize("build, error, match", [
    (lambda: Momentum(0.1, momentum=1.0), fleet.FleetConfigError, r"momentum=1.0\) must be below 1"),
    (lambda: Momentum(-0.1), fleet.FleetConfigError, r"learning_rate=...\) must be a finite number > 0"),
    (lambda: Momentum("0.1"), fleet.FleetTypeError, r"learning_rate=...\) must be a number, got '0.1'"),
    (lambda: Momentum(0.1, use_nesterov=1), fleet.FleetTypeError, r"use_nesterov=...\) must be a bool"),
    (lambda: Adam(1e-3, beta2=1.0), fleet.FleetConfigError, r"Adam\(beta2=1.0\) must be below 1"),
    (lambda: Adam(1e-3, epsilon=-1e-8), fleet.FleetConfigError, r"epsilon=...\) must be a finite"),
])
def test_constructor_refusals(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_unmatched_exclude_name_warns():
    tx = swap_tx(Adam(1e-3), strategy("lamb", exclude_from_weight_decay=["bias", "bais"]))
    with pytest.warns(fleet.FleetWarning, match=r"entries \['bais'\] match no parameter"):
        tx.init(init_params())


def test_state_swap_after_a_step_is_refused():
    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, Momentum(0.1), wrt=nnx.Param)
    x, y = models.batches("linear", 1, BATCH)[0]
    models.nnx_train_step(model, optimizer, x, y)
    with pytest.raises(fleet.FleetConfigError, match=r"has taken 1 steps already.*before training"):
        swap_optimizer_state(optimizer, swap_tx(optimizer.tx, strategy("lars")))


def test_state_swap_without_parameter_shaped_state_is_refused():
    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(fleet.FleetConfigError, match=r"holds nothing shaped like the parameters.*"
                       r"fleet.optimizer.Momentum\(learning_rate=0.1, momentum=0.9\)"):
        swap_optimizer_state(optimizer, optax.lars(0.1))


# -- Through fleet: fleet.init(strategy) -> distributed_optimizer -> distributed_step, 4 devices

N_DEVICES, DIST_TOL = 4, 1e-5
INNER = {"lars": lambda: fleet.optimizer.Momentum(0.1), "lamb": lambda: fleet.optimizer.Adam(1e-2)}
DECAY = {"lars": 0.1, "lamb": 0.5}  # large enough that the exclusions show in the numbers


def configs(section: str, exclude: list[str]) -> dict:
    if section == "lars":
        return dict(lars_coeff=0.01, lars_weight_decay=DECAY["lars"], exclude_from_weight_decay=exclude)
    return dict(lamb_weight_decay=DECAY["lamb"], exclude_from_weight_decay=exclude)


def reference_tx(section: str, mask):
    """optax.lars / optax.lamb written out from ``configs`` (and the inner optimizer's values)."""
    if section == "lars":
        return optax.lars(0.1, weight_decay=DECAY["lars"], weight_decay_mask=mask, trust_coefficient=0.01,
                          momentum=0.9)
    return optax.lamb(1e-2, eps=1e-8, weight_decay=DECAY["lamb"], mask=mask)


def no_decay_on_biases_and_linear2(params):
    """The hand-written NNX mask for exclude_from_weight_decay=["bias", "_linear2"]."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not any(n in jax.tree_util.keystr(path) for n in ("bias", "_linear2")),
        params, is_leaf=lambda x: isinstance(x, nnx.Variable))


@functools.cache
def single_device(section: str, variant: str) -> dict:
    """The single-device NNX run with optax.lars / optax.lamb (``"swapped"``), the
    same without the exclusions (``"no mask"``), or the inner optimizer unswapped."""
    tx = {"swapped": lambda: reference_tx(section, no_decay_on_biases_and_linear2),
          "no mask": lambda: reference_tx(section, True if section == "lars" else None),
          "unswapped": INNER[section]}[variant]()
    model = models.LinearNet(nnx.Rngs(0))
    return nnx_train(nnx.Optimizer(model, tx, wrt=nnx.Param), model)


@pytest.mark.parametrize("section", ["lars", "lamb"])
@pytest.mark.parametrize("wrap", ["nnx.Optimizer", "tx", "both"])
def test_distributed_nnx_equals_single_device_optax(make_world, section, wrap):
    data = models.batches("linear", STEPS, BATCH)
    make_world(N_DEVICES, strategy(section, **configs(section, ["bias", "_linear2"])))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    if wrap == "nnx.Optimizer":
        optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, INNER[section](), wrt=nnx.Param))
    else:
        tx = fleet.distributed_optimizer(INNER[section]())
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        if wrap == "both":
            optimizer = fleet.distributed_optimizer(optimizer)
    step = fleet.distributed_step(models.nnx_train_step, batch_argnums=(2, 3))
    for x, y in data:
        step(model, optimizer, x, y)
    got = models.flat_params(model)
    d = models.max_diff(got, single_device(section, "swapped"))
    d_mask = models.max_diff(got, single_device(section, "no mask"))
    d_inner = models.max_diff(got, single_device(section, "unswapped"))
    print(f"{section}, fleet.distributed_optimizer on the {wrap}, {N_DEVICES} devices: "
          f"|fleet - single-device optax.{section}| = {d:.2e} (without the exclusions: "
          f"{d_mask:.2e}, the inner optimizer unswapped: {d_inner:.2e})")
    assert d < DIST_TOL
    assert d_mask > 10 * DIST_TOL and d_inner > 10 * DIST_TOL  # the comparison can tell
    assert fleet.check_replicas(model) == [] and fleet.check_replicas(optimizer) == []


@pytest.mark.parametrize("section", [pytest.param("lars", marks=slow), "lamb"])
def test_distributed_linen_train_state_equals_single_device_optax(make_world, section):
    data = models.batches("linear", STEPS, BATCH)
    make_world(N_DEVICES, strategy(section, **configs(section, ["bias", "Dense_1"])))
    model = fleet.distributed_model(models.LinenLinearNet())
    params = model.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params,
                              tx=fleet.distributed_optimizer(INNER[section]()))
    step = fleet.distributed_step(models.linen_train_step)
    for x, y in data:
        state, _ = step(state, x, y)
    mask = {"Dense_0": {"kernel": True, "bias": False}, "Dense_1": {"kernel": False, "bias": False}}

    def single_device(mask):
        ref = TrainState.create(apply_fn=model.apply, params=params, tx=reference_tx(section, mask))
        ref_step = jax.jit(models.linen_train_step)
        for x, y in data:
            ref, _ = ref_step(ref, x, y)
        return models.flat_params(ref.params)

    got = models.flat_params(state.params)
    d = models.max_diff(got, single_device(mask))
    d_mask = models.max_diff(got, single_device(True if section == "lars" else None))
    print(f"{section}, Linen TrainState, {N_DEVICES} devices: |fleet - single-device "
          f"optax.{section}| = {d:.2e} (without the exclusions: {d_mask:.2e})")
    assert d < DIST_TOL and d_mask > 10 * DIST_TOL
    assert fleet.check_replicas(state) == []


def test_distributed_optimizer_refuses_the_wrong_inner_optimizer(make_world):
    make_world(N_DEVICES, strategy("lamb"))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    with pytest.raises(fleet.FleetConfigError, match=r"strategy.lamb replaces an Adam optimizer.*"
                       r"got fleet.optimizer.Momentum.*Build it with fleet.optimizer.Adam"):
        fleet.distributed_optimizer(nnx.Optimizer(model, fleet.optimizer.Momentum(0.1), wrt=nnx.Param))
    with pytest.raises(fleet.FleetConfigError, match=r"cannot read.*fleet.optimizer.Adam"):
        fleet.distributed_optimizer(optax.adam(1e-3))
