"""``strategy.verify_steps`` / ``FLEET_VERIFY_STEPS`` (issue 34, fleet/step/_verify.py).

No false alarm: with verify_steps=3, three calls of each step the contract
tests train (NNX CNN + SGD, NNX + Adam, Linen TrainState, global-batch
BatchNorm, dropout, a MultiMetric, float16 amp, attention whose query and key
get zero gradients under Adam) match one device, and each
prints its line. Detection: each of issue 26's bugs, written into a step, raises
naming the leaf that differs. The noise floor: on the contract tests' model, the
perturbation floor is at least the split-sum one.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fleet
from fleet.semantics import _metrics, _outputs, _random
from fleet.step import _graph, _program, _verify, _verify_sections
from tests import models, test_batch_norm_linen, tiers

CALLS, BATCH = 3, 16
FP16 = {"dtype": "float16", "init_loss_scaling": 1024.0}


class BNNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(10, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


class DropNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(10, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


class AttnNet(nnx.Module):
    """Attention over one token repeated: every key scores alike, so the query and key
    projections' gradients are zero, and Adam's moments of them rounding noise."""

    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(10, 8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=rngs)
        self.l2 = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.l1(x))[:, None, :].repeat(5, 1)
        return self.l2(self.attn(h, deterministic=True).mean(1))


def strategy(**fields):
    return fleet.DistributedStrategy(verify_steps=CALLS, **fields)


def nnx_case(net, tx, kind="linear", metric=False, wrap_opt=False):
    model = fleet.distributed_model(net(nnx.Rngs(0, dropout=1)))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if wrap_opt:
        opt = fleet.distributed_optimizer(opt)
    if not metric:
        return fleet.distributed_step(models.nnx_train_step), (model, opt), kind
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))

    def step(model, opt, metrics, x, y):
        loss, grads = nnx.value_and_grad(lambda m: models.loss_of(m(x), y))(model)
        opt.update(model, grads)
        metrics.update(loss=loss, logits=model(x), labels=y)
        return loss

    return fleet.distributed_step(step), (model, opt, metrics), kind


def linen_case():
    module = fleet.distributed_model(models.LinenCNN())
    params = module.init(jax.random.key(0), np.zeros((1, 8, 8, 3), np.float32))["params"]
    state = TrainState.create(apply_fn=module.apply, params=params, tx=optax.adam(models.LR))
    return fleet.distributed_step(models.linen_train_step), state


CASES = {
    "cnn_sgd": (dict(), lambda: nnx_case(models.CNN, optax.sgd(0.1), "cnn")),
    "adam": (dict(), lambda: nnx_case(models.LinearNet, optax.adam(models.LR))),
    "batch_norm": (dict(sync_batch_norm=True), lambda: nnx_case(BNNet, optax.adam(models.LR))),
    "dropout": (dict(), lambda: nnx_case(DropNet, optax.sgd(0.1))),
    # Before: refused at call 3, Adam's second moment of attn.key.kernel (1e-17, noise)
    # beyond its floor (fleet.step._verify, "rounding noise at its own size").
    "zero_gradient": (dict(), lambda: nnx_case(AttnNet, optax.adam(models.LR))),
    "multi_metric": (dict(), lambda: nnx_case(models.CNN, optax.adam(models.LR), "cnn", True)),
    "amp_fp16": (dict(amp=True, amp_configs=FP16),
                 lambda: nnx_case(models.LinearNet, optax.adam(models.LR), wrap_opt=True)),
    "recompute": (dict(recompute=True, recompute_configs={"checkpoints": ["conv1"]}),
                  lambda: nnx_case(models.CNN, optax.sgd(0.1), "cnn")),
    "lamb": (dict(lamb=True), lambda: nnx_case(
        models.LinearNet, fleet.optimizer.Adam(learning_rate=models.LR), wrap_opt=True)),
    "lars": (dict(lars=True), lambda: nnx_case(
        models.LinearNet, fleet.optimizer.Momentum(learning_rate=0.1, momentum=0.9),
        wrap_opt=True)),
    "fp16_allreduce": (dict(fp16_allreduce=True),
                       lambda: nnx_case(models.LinearNet, optax.adam(models.LR))),
    "check_nan_inf": (dict(check_nan_inf=True),
                      lambda: nnx_case(models.LinearNet, optax.adam(models.LR))),
    "amp_bf16": (dict(amp=True), lambda: nnx_case(models.CNN, optax.adam(models.LR), "cnn",
                                                 wrap_opt=True)),
}


#: Cases whose property a default-tier case also checks (the CNN: multi_metric's
#: model; BatchNorm: tests/test_batch_norm.py's equivalence) and the other strategy
#: sections (each checked against one device by its own tests): the slow tier.
SLOW_CASES = ("cnn_sgd", "batch_norm", "recompute", "lamb", "lars", "fp16_allreduce",
              "check_nan_inf", "amp_bf16")


@pytest.mark.parametrize("n", tiers.replicas(2, 4, 8))
@pytest.mark.parametrize("case", [pytest.param(c, marks=tiers.slow) if c in SLOW_CASES else c
                                  for c in sorted(CASES)])
def test_no_false_alarm(make_world, capsys, n, case):
    fields, make = CASES[case]
    make_world(n, strategy(**fields))
    step, objs, kind = make()
    for x, y in models.batches(kind, CALLS + 1, BATCH):
        step(*objs, x, y)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fleet verify")]
    print("\n".join(lines))
    assert len(lines) == CALLS + 1, lines
    for i, line in enumerate(lines[:CALLS]):
        assert line.startswith(f"fleet verify: call {i + 1} of {CALLS} matches one device"), line
    assert "verify is now off" in lines[-1]
    assert all(fleet.check_replicas(o) == [] for o in objs)


@tiers.slow
def test_no_false_alarm_linen_train_state(make_world, capsys):
    make_world(4, strategy())
    step, state = linen_case()
    for x, y in models.batches("cnn", CALLS, BATCH):
        state, _ = step(state, x, y)
    err = capsys.readouterr().err
    print(err)
    assert err.count("matches one device") == CALLS and "verify is now off" in err


def nnx_batch_norm_run(n: int) -> None:
    step, objs, kind = nnx_case(BNNet, optax.adam(models.LR))
    for x, y in models.batches(kind, CALLS + 1, BATCH):
        step(*objs, x, y)


def linen_batch_norm_run(n: int, axis_name: str | None = None) -> None:
    """A Linen TrainState whose nn.BatchNorm keeps batch_stats (the step returns them)."""
    module = fleet.distributed_model(test_batch_norm_linen.LinenNet(axis_name=axis_name))
    state = test_batch_norm_linen.start(module)
    step = fleet.distributed_step(test_batch_norm_linen.train_step)
    for x, y in test_batch_norm_linen.data()[:CALLS + 1]:
        state, _ = step(state, x, y)


@pytest.mark.parametrize("n", tiers.replicas(2, 4))
@pytest.mark.parametrize("run", [nnx_batch_norm_run, linen_batch_norm_run],
                         ids=["nnx", "linen"])
def test_per_replica_batch_norm_is_checked_against_its_documented_reference(
        make_world, capsys, monkeypatch, n, run):
    """strategy.sync_batch_norm=False: each replica normalises its own rows, the one
    documented difference from one device. verify's reference is that: the
    single-device step whose BatchNorm (nnx.BatchNorm, or a wrapped Linen
    module's nn.BatchNorm) normalises each replica's rows apart and averages the
    running statistics. No false alarm over 3 calls; against the global-batch
    reference (the per-replica one switched off) the BatchNorm's statistics
    differ, and verify names them."""
    make_world(n, strategy(sync_batch_norm=False))
    run(n)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fleet verify")]
    print("\n".join(lines))
    assert sum("matches one device" in ln for ln in lines) == CALLS, lines
    monkeypatch.setattr(_verify_sections, "per_replica_batch_norm",
                        lambda *args: contextlib.nullcontext())
    make_world(n, strategy(sync_batch_norm=False))
    with pytest.raises(fleet.FleetError, match=r"verify, call 1: .*differs from the single") as e:
        run(n)
    print(str(e.value).splitlines()[0])
    assert re.search(r"(bn|BatchNorm_0)\.(mean|var|bias|scale)|output", str(e.value)), e.value


@pytest.mark.parametrize("case", ["axis_name=fleet.DATA_AXIS", "sync_batch_norm=True"])
def test_no_false_alarm_linen_global_batch_norm(make_world, capsys, case):
    """A Linen nn.BatchNorm over the global batch (either way of asking for it)
    against the plain single-device step."""
    axis_name, choice, _ = test_batch_norm_linen.CASES[case]
    make_world(4, strategy(sync_batch_norm=choice))
    linen_batch_norm_run(4, axis_name)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fleet verify")]
    print("\n".join(lines))
    assert sum("matches one device" in ln for ln in lines) == CALLS, lines


# -- the sections whose state has no plain counterpart: sharding, accumulated gradients --

SHARDING = {1: dict(sharding=True, sharding_configs={"stage": 1}),
            2: dict(sharding=True, sharding_configs={"stage": 2})}
MERGE = dict(gradient_merge=True, gradient_merge_configs={"k_steps": 2})


def verify_lines(capsys) -> list[str]:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fleet verify")]
    print("\n".join(lines))
    return lines


@pytest.mark.parametrize("stage", [pytest.param(1, marks=tiers.slow),
                                   pytest.param(2, marks=tiers.slow)])
def test_no_false_alarm_under_sharding_nnx(make_world, capsys, stage):
    """ZeRO: the optimizer state is compared in its logical layout (gathered from
    the replicas' chunks) with one device's Adam on the full state."""
    make_world(4, strategy(**SHARDING[stage]))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in models.batches("linear", CALLS + 1, BATCH):
        step(model, opt, x, y)
    assert opt.sharded
    lines = verify_lines(capsys)
    assert [ln.split(" matches")[0] for ln in lines[:CALLS]] == [
        f"fleet verify: call {i + 1} of {CALLS}" for i in range(CALLS)]
    assert "verify is now off" in lines[-1] and len(lines) == CALLS + 1
    assert fleet.check_replicas(model) == []


@pytest.mark.parametrize("stage", [pytest.param(1, marks=tiers.slow),
                                   pytest.param(2, marks=tiers.slow)])
def test_no_false_alarm_under_sharding_linen(make_world, capsys, stage):
    """A Linen TrainState whose distributed optax transformation holds Shard nodes."""
    make_world(4, strategy(**SHARDING[stage]))
    data = models.batches("linear", CALLS + 1, BATCH)
    module = models.LINEN_MODELS["linear"]()
    params = models.linen_init("linear", data)["params"]
    state = TrainState.create(apply_fn=fleet.distributed_model(module).apply, params=params,
                              tx=fleet.distributed_optimizer(optax.adam(models.LR)))
    step = fleet.distributed_step(models.linen_train_step)
    for x, y in data:
        state, _ = step(state, x, y)
    lines = verify_lines(capsys)
    assert sum("matches one device" in ln for ln in lines) == CALLS
    assert "verify is now off" in lines[-1]


def test_no_false_alarm_under_gradient_merge(make_world, capsys):
    """k_steps=2, Adam: the reference keeps its own single-device sum of the
    global-batch gradients; the first call of a cycle leaves parameters, Adam's
    state and step unchanged on both sides, the second steps with the mean."""
    make_world(4, strategy(**MERGE))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in models.batches("linear", CALLS + 1, BATCH):
        step(model, opt, x, y)
    lines = verify_lines(capsys)
    assert len(lines) == CALLS + 1 and all("matches one device" in ln for ln in lines)
    assert ["accumulated)" in ln for ln in lines] == [True, False] * 2
    assert ["applied, / 2)" in ln for ln in lines] == [False, True] * 2
    assert int(opt.step[...]) == 2 and fleet.check_replicas(model) == []


@tiers.slow
def test_no_false_alarm_under_no_sync(make_world, capsys):
    """Calls inside no_sync, each followed by a synced one (which steps with the
    sum of both calls' gradients, as documented), then two inside no_sync of
    which verify checks only the first (its 3 calls of that plan are done): the
    synced call that applies them is skipped, and said, not a false alarm."""
    make_world(4, strategy())
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    for synced, (x, y) in zip([0, 1, 0, 1, 0, 0, 1], models.batches("linear", 7, BATCH)):
        if synced:
            step(model, opt, x, y)
        else:
            with model.no_sync():
                step(model, opt, x, y)
    lines = verify_lines(capsys)
    assert ["matches one device" in ln for ln in lines] == [True] * 5 + [False], lines
    assert sum("(gradients accumulated)" in ln for ln in lines) == 3
    assert sum("(accumulated gradients applied)" in ln for ln in lines) == 2
    assert "skipped this call: it adds to or applies gradients accumulated" in lines[-1]
    assert int(opt.step[...]) == 3 and fleet.check_replicas(model) == []


@tiers.slow
def test_gradient_merge_begun_before_verify_is_skipped_then_checked(make_world, capsys,
                                                                   monkeypatch):
    """A step whose optimizer is mid-cycle when verify first sees it (another step
    made the cycle's first call): the call that applies that sum is skipped and
    said; the next cycle, seen whole, is checked."""
    make_world(4, fleet.DistributedStrategy(**MERGE))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param))
    data = models.batches("linear", 4, BATCH)
    fleet.distributed_step(models.nnx_train_step)(model, opt, *data[0])
    monkeypatch.setenv(_verify.ENV, "3")
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in data[1:]:
        step(model, opt, x, y)
    lines = verify_lines(capsys)
    assert "skipped this call: it adds to or applies gradients accumulated" in lines[0]
    assert ["matches one device" in ln for ln in lines] == [False, True, True], lines


class Seen(nnx.Module):
    def __init__(self):
        self.count = nnx.Variable(jnp.zeros((), jnp.float32))


def test_detects_a_counter_averaged_under_sharding_stage_2(make_world):
    """(Default tier: the model's and the sharded optimizer's leaves, compared
    first, match one device at call 1; the counter, averaged, is named.)"""
    def step(model, opt, seen, x, y):
        seen.count[...] += fleet.all_reduce(jnp.float32(x.shape[0]), "avg")  # should be "sum"
        return models.nnx_train_step(model, opt, x, y)

    make_world(4, strategy(**SHARDING[2]))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param))
    with pytest.raises(fleet.FleetError, match=r"call 1: the 3rd argument \(Seen\) variable 'count' "
                                               r"differs.*norm 4 distributed vs 16 on one"):
        run_detect(fleet.distributed_step(step), model, opt, Seen())


@tiers.slow
def test_detects_a_summed_loss_under_gradient_merge(make_world):
    """A loss summed over the batch and declared 'sum': the accumulated gradient
    is 4x too small; the applying call names a parameter."""
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).sum())(model)
        opt.update(model, grads)
        return loss

    make_world(4, strategy(**MERGE))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    with pytest.raises(fleet.FleetError, match=r"call 1: the 1st argument \(DataParallel.*variable "
                                               r"'.*' differs.*loss summed over the batch"):
        run_detect(fleet.distributed_step(step, out_reduce="sum"), model, opt)


# -- detection: issue 26's bugs, each named ------------------------------------------

def run_detect(step, *objs, kind="linear", calls=CALLS):
    try:
        for x, y in models.batches(kind, calls, BATCH):
            step(*objs, x, y)
    except fleet.FleetError as e:
        print(str(e).split("\n")[0])  # the message, for the log
        raise


def sgd_model():
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def test_detects_a_max_declared_mean(make_world):
    def step(model, opt, x, y):
        loss = models.nnx_train_step(model, opt, x, y)
        return loss, jnp.max(jnp.abs(x))

    make_world(4, strategy())
    step = fleet.distributed_step(step, out_reduce=(None, "mean"))
    with pytest.raises(fleet.FleetError, match=r"verify, call 1: output 1 differs .*max "
                                               r"\|difference\|.*> noise floor.*'mean'"):
        run_detect(step, *sgd_model())


def test_detects_a_counter_averaged(make_world):
    def step(model, opt, seen, x, y):
        seen.count[...] += fleet.all_reduce(jnp.float32(x.shape[0]), "avg")  # should be "sum"
        return models.nnx_train_step(model, opt, x, y)

    make_world(4, strategy())
    with pytest.raises(fleet.FleetError, match=r"call 1: the 3rd argument \(Seen\) variable 'count' "
                                               r"differs.*norm 4 distributed vs 16 on one"
                                               r".*all_reduce\(\.\.\., 'avg'\)"):
        run_detect(fleet.distributed_step(step), *sgd_model(), Seen())


def test_detects_a_closed_over_array_sliced_by_the_batch(make_world):
    weights = np.linspace(0.1, 2.0, BATCH).astype(np.float32)[:, None]

    def step(model, opt, x, y):
        def loss_fn(m):
            return (weights[: x.shape[0]] * (m(x) - y) ** 2).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    make_world(4, strategy())
    with pytest.raises(fleet.FleetError, match=r"call 1: the 1st argument \(DataParallel.*variable "
                                               r"'_linear1.bias' differs.*closed-over array"):
        run_detect(fleet.distributed_step(step), *sgd_model())


def test_detects_per_replica_randomness(make_world, monkeypatch):
    """fleet re-types keys so every replica draws its rows of the single-device
    mask; with that and its guard off (the old bug: every replica draws the
    first rows' mask) verify names the first leaf the mask changes. (A key
    folded with jax.lax.axis_index cannot run on one device: no axis there.)"""
    monkeypatch.setattr(_random.Keys, "enter", lambda self, tree, optimizer_held=None: tree)
    monkeypatch.setattr(_program, "check_randomness", lambda *args: None)
    make_world(4, strategy())
    model = fleet.distributed_model(DropNet(nnx.Rngs(0, dropout=1)))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(fleet.FleetError, match=r"call 1: .* differs from the single-device"):
        run_detect(fleet.distributed_step(models.nnx_train_step), model, opt)


@tiers.slow
def test_detects_metric_counts_with_the_metrics_fix_off(make_world, monkeypatch):
    """fleet updates a metric with the global batch's values and refuses counts
    of the replica's rows; with both off and float state averaged as fleet did
    before (the old bug: each replica counts its own rows, the totals are
    averaged), verify names the metric's count."""
    monkeypatch.setattr(_metrics, "global_updates", lambda *args: contextlib.nullcontext())
    monkeypatch.setattr(_outputs, "check_counted", lambda *args: None)
    monkeypatch.setattr(_graph, "running_statistics", lambda nodes: {
        id(v) for v in nodes if isinstance(v, nnx.Variable)
        and jnp.issubdtype(jnp.result_type(v.get_raw_value()), jnp.inexact)})

    def step(model, opt, accuracy, x, y):
        loss = models.nnx_train_step(model, opt, x, y)
        accuracy.update(logits=model(x), labels=y)
        return loss

    make_world(4, strategy())
    model = fleet.distributed_model(models.CNN(nnx.Rngs(0)))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(fleet.FleetError, match=r"call 1: the 3rd argument \(Accuracy\) variable "
                                               r"'(count|total)' differs"):
        run_detect(fleet.distributed_step(step), model, opt, nnx.metrics.Accuracy(),
                   kind="cnn")


def test_detects_a_summed_loss_declared_sum(make_world):
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).sum())(model)
        opt.update(model, grads)
        return loss

    make_world(4, strategy())
    with pytest.raises(fleet.FleetError, match=r"call 1: the 1st argument \(DataParallel.*variable "
                                               r"'.*' differs.*loss summed over the batch"):
        run_detect(fleet.distributed_step(step, out_reduce="sum"), *sgd_model())


# -- switches ------------------------------------------------------------------------

def test_a_step_that_fails_on_one_device_is_named(make_world):
    """A step fleet runs but the single-device step cannot (it asks for the
    replica's index): verify cannot compare it and says so, naming JAX's error,
    instead of letting the raw error through."""
    def step(model, opt, x, y):
        jax.lax.axis_index("data")  # (no such axis on one device)
        return models.nnx_train_step(model, opt, x, y)

    make_world(4, strategy())
    with pytest.raises(fleet.FleetError, match=r"verify, call 1: the distributed step ran, "
                                               r"but the same step function fails as the "
                                               r"single-device step .*NameError"):
        run_detect(fleet.distributed_step(step), *sgd_model())


def test_env_variable_turns_it_on(make_world, capsys, monkeypatch):
    monkeypatch.setenv(_verify.ENV, "2")
    make_world(4)
    step = fleet.distributed_step(models.nnx_train_step)
    model, opt = sgd_model()
    for x, y in models.batches("linear", 3, BATCH):
        step(model, opt, x, y)
    err = capsys.readouterr().err
    assert "call 2 of 2 matches one device" in err and "2 calls of this step matched" in err


def test_off_by_default_and_bad_values_raise(make_world, capsys, monkeypatch):
    make_world(4)
    step = fleet.distributed_step(models.nnx_train_step)
    step(*sgd_model(), *models.batches("linear", 1, BATCH)[0])
    assert "fleet verify" not in capsys.readouterr().err and not step._verify.active
    with pytest.raises(fleet.FleetConfigError, match="verify_steps must be 0 .off. or a pos"):
        fleet.DistributedStrategy(verify_steps=-1)
    monkeypatch.setenv(_verify.ENV, "-2")
    step = fleet.distributed_step(models.nnx_train_step)
    with pytest.raises(fleet.FleetConfigError, match="FLEET_VERIFY_STEPS='-2' must be 0"):
        step(*sgd_model(), *models.batches("linear", 1, BATCH)[0])


# -- the floor -----------------------------------------------------------------------

@pytest.mark.parametrize("tx_name", ["sgd", "adam"])
def test_perturbation_floor_covers_the_split_sum_floor(tx_name):
    """On the contract tests' model and data (4 replicas), the floor verify uses
    is at least the distance between the split-sum and the plain step, per leaf."""
    tx = {"sgd": optax.sgd(0.1), "adam": optax.adam(models.LR)}[tx_name]
    x, y = models.batches("linear", 1, BATCH)[0]

    def run(split, scale):
        model = models.LinearNet(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        nnx.update(model, jax.tree.map(lambda p: p * scale, nnx.state(model, nnx.Param)))

        @nnx.jit
        def step(model, opt, x, y):
            grad = lambda a, b: nnx.grad(lambda m: models.loss_of(m(a), b))(model)  # noqa: E731
            opt.update(model, models.split_mean_grad(grad, x, y, 4) if split else grad(x, y))

        step(model, opt, x * scale, y * scale)
        return models.flat_params(model)

    plain, split, pert = run(False, 1.0), run(True, 1.0), run(False, np.float32(1 + 2.0 ** -20))
    for k in plain:
        eps = float(np.finfo(np.float32).eps)
        floor = 8 * np.abs(pert[k] - plain[k]).max() + 16 * eps * np.abs(plain[k]).max()
        split_floor = np.abs(split[k] - plain[k]).max()
        print(f"{tx_name} {k}: perturbation floor {floor:.2e} >= split-sum floor {split_floor:.2e}")
        assert floor >= split_floor, k
