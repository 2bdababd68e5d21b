"""A repeated call's fast path (``fleet.step._recall``, issue 24): a call with the same
objects skips deciding again, and every change between two calls that the full
path would see is still seen: each test changes something between calls and
compares with the single-device step (``nnx.jit``) given the same changes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fleet
from fleet.step import _decorator
from tests import models
from tests.test_no_sync import scaled_step


class Scaled(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(10, 1, rngs=rngs)
        self.scale = 2.0  # a static setting
        self.extra = nnx.List([])  # more layers, added in place

    def __call__(self, x):
        y = self.linear(x) * self.scale
        for layer in self.extra:
            y = y + layer(x)
        return y


def sgd_step(model, x, y):
    loss, grads = nnx.value_and_grad(lambda m: models.loss_of(m(x), y))(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return loss


def run_both(make_world, changes, step_fn=sgd_step, steps=None):
    """Runs ``step_fn`` on one device (``nnx.jit``) and with fleet on 4, calling
    ``changes[k](model)`` on both after call ``k``; returns both losses and
    parameters."""
    data = models.batches("linear", steps or max(changes) + 2, 8)  # a call after each change
    reference = Scaled(nnx.Rngs(0))
    single = nnx.jit(step_fn)
    make_world(4)
    model = fleet.distributed_model(Scaled(nnx.Rngs(0)))
    step = fleet.distributed_step(step_fn)
    want, got = [], []
    for k, (x, y) in enumerate(data):
        want.append(float(single(reference, x, y)))
        got.append(float(step(model, x, y)))
        if k in changes:
            changes[k](reference)
            changes[k](model)
    assert fleet.check_replicas(model) == []  # every device holds the same parameters
    return want, got, models.flat_params(reference), models.flat_params(model), step


def count_decisions(monkeypatch) -> list:
    decided = []
    original = _decorator.DistributedStep._decide
    monkeypatch.setattr(_decorator.DistributedStep, "_decide",
                        lambda self, *a: decided.append(1) or original(self, *a))
    return decided


def test_a_repeated_call_takes_the_fast_path(make_world, monkeypatch):
    decided = count_decisions(monkeypatch)
    want, got, ref, params, _ = run_both(make_world, {}, steps=5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert models.max_diff(params, ref) < 1e-6
    assert len(decided) == 1  # the first call; four recalled


def test_a_static_setting_changed_between_calls_is_seen(make_world):
    def rescale(m):
        m.scale = 3.0

    want, got, ref, params, step = run_both(make_world, {1: rescale})
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert models.max_diff(params, ref) < 1e-6
    assert step.trace_count == 2


def test_a_layer_added_in_place_is_seen(make_world):
    """nnx.List.append changes the graph without a new attribute on the model: the
    next call trains the new layer, as on one device. (Spec since issue 33: the
    wrapped model's call syncs every parameter it holds, a layer added after the
    wrapping too, so its gradient is averaged; before, it was refused as a
    gradient JAX would sum over the replicas.)"""
    def grow(m):
        m.extra.append(nnx.Linear(10, 1, rngs=nnx.Rngs(1)))

    want, got, ref, params, step = run_both(make_world, {1: grow})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert "['extra'][0]['kernel']" in params and models.max_diff(params, ref) < 1e-6
    assert step.trace_count == 2


def test_a_layer_added_in_place_is_used_in_an_eval_step(make_world):
    def grow(m):
        m.extra.append(nnx.Linear(10, 1, rngs=nnx.Rngs(1)))

    def evaluate(model, x, y):
        return models.loss_of(model(x), y)

    want, got, _, _, step = run_both(make_world, {0: grow, 1: grow}, step_fn=evaluate)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert len(set(got)) == 3 and step.trace_count == 3


def test_a_variable_replaced_by_an_equal_one_is_the_one_trained(make_world):
    """A new variable of the same class holding the same values: the step must
    write the new object (the old one is no longer the model's)."""
    def replace_bias(m):
        old = m.linear.bias
        m.linear.bias = type(old)(jnp.array(np.asarray(old[...])))

    want, got, ref, params, _ = run_both(make_world, {0: replace_bias, 2: replace_bias})
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert models.max_diff(params, ref) < 1e-6


def test_a_sub_module_replaced_is_the_one_used(make_world):
    """A new layer in a wrapped model, put in after the wrapping: the next call
    trains it, as on one device (spec since issue 33, as above)."""
    def replace(m):
        m.linear = nnx.Linear(10, 1, rngs=nnx.Rngs(2))

    want, got, ref, params, _ = run_both(make_world, {1: replace})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert models.max_diff(params, ref) < 1e-6


def linear_net(make_world):
    """The world on 4 devices, a wrapped LinearNet, and its single-device twin."""
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    return fleet.world(), model, models.LinearNet(nnx.Rngs(0))


def test_an_array_that_changes_role_is_seen(make_world):
    """The same position gets a sharded batch, then an array replicated on every
    device (state, as a step's own output is), then numpy rows of another dtype."""
    w, model, reference = linear_net(make_world)

    @fleet.distributed_step
    def mean_out(model, x):
        return model(x).mean()

    x = np.random.RandomState(0).randn(8, 10).astype(np.float32)
    want = float(reference(x).mean())
    for _ in range(2):
        assert abs(float(mean_out(model, jax.device_put(x, w.batch))) - want) < 1e-6
    assert abs(float(mean_out(model, jax.device_put(x, w.replicated))) - want) < 1e-6
    assert abs(float(mean_out(model, x.astype(np.float64))) - want) < 1e-6


def test_a_batch_of_another_size_stays_on_the_fast_path(make_world, monkeypatch):
    """Placed batches of 8 rows, then of 4 (an epoch's last batch): every call is
    recalled and equals the single-device step; the first 4-row batch is checked
    and placed (``global_batch``), and the fast path compares the next ones with it
    (they pass as they are)."""
    from fleet.step import _recall

    decided, placed, place = count_decisions(monkeypatch), [], _recall.global_batch
    monkeypatch.setattr(_recall, "global_batch", lambda *a: placed.append(1) or place(*a))
    make_world(4)
    w = fleet.world()
    reference, single = Scaled(nnx.Rngs(0)), nnx.jit(sgd_step)
    model, step = fleet.distributed_model(Scaled(nnx.Rngs(0))), fleet.distributed_step(sgd_step)
    counts = []
    for k, (x, y) in enumerate(models.batches("linear", 6, 8)):
        rows = 8 if k < 3 else 4
        want = float(single(reference, x[:rows], y[:rows]))
        x, y = jax.device_put(x[:rows], w.batch), jax.device_put(y[:rows], w.batch)
        before = len(placed)
        assert float(step(model, x, y)) == pytest.approx(want, rel=1e-6, abs=1e-6), k
        counts.append(len(placed) - before)
    assert models.max_diff(models.flat_params(model), models.flat_params(reference)) < 1e-6
    assert fleet.check_replicas(model) == []
    assert len(decided) == 1
    assert counts == [0, 0, 0, 2, 0, 0]


def test_a_linen_train_state_step_is_recalled(make_world, monkeypatch):
    """A Linen TrainState (pytree state) and numpy rows: every call after the
    first is recalled, and the run equals the single-device one."""
    decided = count_decisions(monkeypatch)
    data = models.batches("linear", 5, 8)
    want_losses, want = models.linen_reference("linear", data)
    make_world(4)
    module = fleet.distributed_model(models.LINEN_MODELS["linear"]())
    state = TrainState.create(apply_fn=module.apply,
                              params=models.linen_init("linear", data)["params"],
                              tx=fleet.distributed_optimizer(optax.adam(models.LR)))
    step = fleet.distributed_step(models.linen_train_step)
    losses = []
    for x, y in data:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert models.max_diff(models.flat_params(state.params), want) < 1e-5
    assert fleet.check_replicas(state) == []
    assert len(decided) == 1


def test_a_dict_batch_is_recalled_and_its_role_is_decided_at_each_call(make_world,
                                                                       monkeypatch):
    """A batch given as a dict is recalled; the same dict of arrays replicated on
    every device (state, as a step's own output is) is not split."""
    decided = count_decisions(monkeypatch)
    w, model, reference = linear_net(make_world)

    @fleet.distributed_step
    def rows_out(model, batch):
        return model(batch["x"])

    x = np.random.RandomState(0).randn(8, 10).astype(np.float32)
    want = np.asarray(reference(x))
    for _ in range(3):  # rows: split, and gathered back in order
        np.testing.assert_allclose(rows_out(model, {"x": x}), want, rtol=1e-6, atol=1e-6)
    assert len(decided) == 1
    # The same rows on every device: replicated state, each replica computes all rows.
    np.testing.assert_allclose(rows_out(model, {"x": jax.device_put(x, w.replicated)}), want,
                               rtol=1e-6, atol=1e-6)
    assert len(decided) == 2


def test_pytree_state_of_another_structure_gets_its_own_outputs(make_world):
    """The same step given replicated parameters of another structure (other
    names): it returns them under their own names, as jax.jit does (the record of
    a program's outputs belongs to one argument structure: Plan.arg_structure;
    before, the second call returned the first call's names)."""
    make_world(4)
    replicated = fleet.world().replicated

    def scale(params, x):
        return jax.tree.map(lambda p: p * 2.0, params), x.mean()

    step, single = fleet.distributed_step(scale), jax.jit(scale)
    x = np.ones((8, 3), np.float32)
    for names in (("a", "b"), ("c", "d"), ("c", "d"), ("a", "b")):
        params = {n: jnp.full(3, float(k)) for k, n in enumerate(names)}
        got, _ = step(jax.device_put(params, replicated), x)
        want, _ = single(params, x)
        assert sorted(got) == sorted(want) == sorted(names)
        for n in names:
            np.testing.assert_array_equal(got[n], want[n])


def linear_training(make_world):
    """The seeds' LinearNet with SGD on 4 devices: model, optimizer, step, a batch."""
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    (x, y), = models.batches("linear", 1, 8)
    return model, optimizer, fleet.distributed_step(models.nnx_train_step), x, y


def test_a_batch_that_no_longer_splits_is_still_refused(make_world):
    model, optimizer, step, x, y = linear_training(make_world)
    for _ in range(3):
        step(model, optimizer, x, y)
    with pytest.raises(fleet.FleetConfigError, match="multiple of the 4 replicas"):
        step(model, optimizer, x[:6], y[:6])


def test_a_static_argument_changed_between_calls_is_seen(make_world):
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    reference = models.LinearNet(nnx.Rngs(0))

    def scaled(model, x, how):
        return model(x).mean() * {"double": 2.0, "triple": 3.0}[how]

    step = fleet.distributed_step(scaled)
    x = np.random.RandomState(0).randn(8, 10).astype(np.float32)
    for how in ("double", "double", "triple", "triple", "double"):
        assert abs(float(step(model, x, how)) - float(scaled(reference, x, how))) < 1e-6, how
    assert step.trace_count == 2


def test_check_nan_inf_switched_on_between_calls_is_seen(make_world):
    model, optimizer, step, x, y = linear_training(make_world)
    step(model, optimizer, x, y)
    step(model, optimizer, x, y)
    fleet.world().strategy.check_nan_inf = True
    step(model, optimizer, np.full_like(x, np.nan), y)
    with pytest.raises(fleet.FleetError, match="check_nan_inf"):
        step.wait()


def test_only_a_call_whose_decisions_changed_takes_the_decision_path(make_world):
    """The decision path (``DistributedStep._decide``, counted) runs for the first
    call and for each call whose decisions changed: a jax.Array batch after numpy
    rows, another model object, the first object again, a static setting changed;
    a batch of another size decides nothing (its shape is no decision's input) and
    takes the cached path. Each call equals the single-device step."""
    make_world(4)
    w = fleet.world()
    single = nnx.jit(sgd_step)
    references = [Scaled(nnx.Rngs(0)), Scaled(nnx.Rngs(1))]
    fleets = [fleet.distributed_model(Scaled(nnx.Rngs(0))),
              fleet.distributed_model(Scaled(nnx.Rngs(1)))]
    step = fleet.distributed_step(sgd_step)

    def placed(x):
        return jax.device_put(x, w.batch)

    def rescale(m):
        m.scale = 3.0

    calls = [  # (which model, rows, place the batch, a change before the call, decisions after)
        (0, 8, False, None, 1), (0, 8, False, None, 1), (0, 4, False, None, 1),
        (0, 8, True, None, 2), (0, 4, True, None, 2), (1, 8, True, None, 3),
        (1, 8, True, None, 3), (0, 8, True, None, 4), (0, 8, True, rescale, 5),
        (0, 8, True, None, 5)]
    decisions = []
    for (x, y), (m, rows, place, change, _) in zip(models.batches("linear", len(calls), 8),
                                                  calls):
        if change is not None:
            change(references[m])
            change(fleets[m])
        x, y = x[:rows], y[:rows]
        want = float(single(references[m], x, y))
        got = float(step(fleets[m], *((placed(x), placed(y)) if place else (x, y))))
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6), len(decisions)
        decisions.append(step._decisions)
    assert decisions == [c[-1] for c in calls]
    for reference, model in zip(references, fleets):  # (parameters near 4: float rounding)
        assert models.max_diff(models.flat_params(model), models.flat_params(reference)) < 1e-5
        assert fleet.check_replicas(model) == []


def test_no_sync_and_gradient_merge_calls_take_the_decision_path(make_world):
    """A call under ``no_sync`` decides again (no_sync is a decision's input), and
    so does the first call after the block; the next one is cached again. Under
    gradient merge every call decides (its position in the merge). The results
    equal the single-device steps on the union batches (SGD, the loss divided by
    the calls that make one update)."""
    (x, y), = models.batches("linear", 1, 8)
    reference = models.LinearNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    single = nnx.jit(models.nnx_train_step)
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    plain, third = fleet.distributed_step(models.nnx_train_step), fleet.distributed_step(
        scaled_step(1 / 3))
    plain(model, optimizer, x, y)
    plain(model, optimizer, x, y)
    assert plain._decisions == 1
    for _ in range(2):
        with model.no_sync():
            third(model, optimizer, x, y)
    assert third._decisions == 2
    third(model, optimizer, x, y)  # leaves no_sync: the accumulated update
    assert third._decisions == 3
    third(model, optimizer, x, y)
    assert third._decisions == 3
    for _ in range(3):  # 2 plain steps, one step on 3 copies of the batch
        single(reference, ref_opt, x, y)
    nnx.jit(scaled_step(1 / 3))(reference, ref_opt, x, y)
    assert models.max_diff(models.flat_params(model), models.flat_params(reference)) < 1e-5

    strategy = fleet.DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    make_world(4, strategy)
    reference = models.LinearNet(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    merged = fleet.distributed_step(models.nnx_train_step)
    for _ in range(4):
        merged(model, optimizer, x, y)
    assert merged._decisions == 4
    for _ in range(2):  # each merge of 2 calls on the same batch: one step on it
        single(reference, ref_opt, x, y)
    assert models.max_diff(models.flat_params(model), models.flat_params(reference)) < 1e-5
    assert fleet.check_replicas(model) == []
