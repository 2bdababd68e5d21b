"""sharding_configs.stage = 3 (issue 37): the parameters split too, against the unsharded run.

The default tier runs stage 3 once on 4 devices against the unsharded run
(Adam, Linen), the parameters read outside ``__call__`` and its refusals; the
slow tier the other device counts (LAMB's whole-tensor norms among them) and
optimizers (clip_by_global_norm; plain SGD, no state shaped like the
parameters), the comparison with one device, the other Linen runs, float16 amp,
fp16_allreduce, verify_steps, optax.MultiSteps, per-replica BatchNorm, stage 2's
weight-decay row, the Linen checkpoint and the checkpoints saved elsewhere; the
extended tier (tests/costly_tests.txt) LAMB on 4 devices, bfloat16 amp,
recompute, check_nan_inf and BatchNorm with stage 3, fleet.Model and the
checkpoint saved at stage 3.

The reference is the same fleet run with ``strategy.sharding`` off (itself
tested against the single-device step elsewhere, and here once against
``nnx.jit`` on one device): stage 3 changes where the parameters live and how
they reach the model, not the arithmetic, so the parameters and the optimizer
state must be within 1e-6 of it. Each replica's copy of what stays replicated
(the step count, Adam's count) is checked equal, and each parameter's bytes
per device are 1/N of its padded size.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fleet
from fleet.sections import _sharding, _stage3
from tests import models, tiers
from tests.test_sharding import (
    OPTIMIZERS,
    assert_restores,
    bytes_on,
    fleet_model_and_the_loop,
    logical_opt_state,
    strategy,
    train_nnx,
)

STEPS = 12
OPTIMIZERS = {**OPTIMIZERS, "sgd": lambda: optax.sgd(1e-1),  # (no state: the parameters split)
              "clip+adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))}


def sharded_params(model) -> list:
    return [v for v in jax.tree.leaves(nnx.state(model, nnx.Param),
                                       is_leaf=lambda v: isinstance(v, nnx.Variable))
            if _sharding.layout_of(v) is not None]


def assert_replicated_state_equal(opt) -> None:
    """Every leaf of ``opt`` that is not split is the same on every device."""
    for v in jax.tree.leaves(nnx.state(opt), is_leaf=lambda v: isinstance(v, nnx.Variable)):
        if _sharding.layout_of(v) is not None:
            continue
        shards = [np.asarray(s.data) for s in v.get_raw_value().addressable_shards]
        assert all(np.array_equal(shards[0], s) for s in shards[1:])


def compare(kind, data, tx, devices, stage=3, step_fn=models.nnx_train_step, **sections):
    """The stage-3 run and the unsharded run of ``kind`` on ``data``: their
    distances (parameters, optimizer state) and the stage-3 model and optimizer."""
    make_world_ = compare.make_world
    make_world_(devices, strategy(**sections))
    ref_model, ref_opt, _, ref_losses = train_nnx(kind, data, tx(), step_fn)
    make_world_(devices, strategy(stage, **sections))
    model, opt, _, losses = train_nnx(kind, data, tx(), step_fn)
    d_params = models.max_diff(models.flat_params(model), models.flat_params(ref_model))
    d_state = models.max_diff(logical_opt_state(opt), logical_opt_state(ref_opt))
    d_loss = float(np.max(np.abs(np.subtract(losses, ref_losses))))
    return d_params, d_state, d_loss, model, opt


@pytest.fixture(autouse=True)
def _world(make_world):
    compare.make_world = make_world


# -- acceptance 1 and 2: the step equals the unsharded step --------------------------------------

@pytest.mark.parametrize("devices", tiers.devices(2, 4, 8, core=True))
@pytest.mark.parametrize("opt_name", ["adam", "lamb", pytest.param("clip+adam", marks=tiers.slow),
                                      pytest.param("sgd", marks=tiers.slow),
                                      pytest.param("momentum", marks=tiers.slow)])
def test_stage_3_equals_the_unsharded_run(devices, opt_name):
    data = models.batches("linear", STEPS, 16)
    d_params, d_state, d_loss, model, opt = compare("linear", data, OPTIMIZERS[opt_name], devices)
    print(f"stage 3, {opt_name}, {devices} devices: |params| = {d_params:.2e}, "
          f"|opt state| = {d_state:.2e}, |losses| = {d_loss:.2e}")
    assert d_params < 1e-6 and d_state < 1e-6 and d_loss < 1e-6
    params = sharded_params(model)
    assert len(params) == 4 and opt.sharded
    device = jax.devices()[0]
    for v in params:  # each device holds its chunk of each parameter
        layout = _sharding.layout_of(v)
        assert bytes_on(v.get_raw_value(), device) == layout.chunk * 4
    assert_replicated_state_equal(opt)


def train_linen(kind, data, tx, steps=None):
    model = fleet.distributed_model(models.LINEN_MODELS[kind]())
    state = TrainState.create(apply_fn=model.apply,
                              params=model.init(jax.random.key(0), data[0][0])["params"],
                              tx=fleet.distributed_optimizer(tx))
    step = fleet.distributed_step(models.linen_train_step)
    losses = []
    for x, y in data[:steps]:
        state, loss = step(state, x, y)
        losses.append(float(loss))
    return model, state, losses


@pytest.mark.parametrize("kind, opt_name, devices", [
    ("linear", "adam", 4), pytest.param("linear", "adam", 2, marks=tiers.slow),
    pytest.param("linear", "adam", 8, marks=tiers.slow),
    pytest.param("cnn", "lamb", 4, marks=tiers.slow),
    pytest.param("linear", "clip+adam", 4, marks=tiers.slow),
    pytest.param("linear", "sgd", 4, marks=tiers.slow)])
def test_linen_stage_3_equals_the_unsharded_run(make_world, kind, opt_name, devices):
    """A Linen TrainState: the wrapped model's init splits the parameters (each a
    Shard, as the optimizer state's leaves are), apply gathers them."""
    data = models.batches(kind, 8, 16)
    make_world(devices, strategy())
    _, ref, ref_losses = train_linen(kind, data, OPTIMIZERS[opt_name]())
    make_world(devices, strategy(3))
    model, state, losses = train_linen(kind, data, OPTIMIZERS[opt_name]())
    shards = jax.tree.leaves(state.params, is_leaf=_sharding.is_shard)
    assert shards and all(map(_sharding.is_shard, shards))
    d_params = models.max_diff(models.flat_params(_stage3.whole_params(state.params)),
                               models.flat_params(ref.params))
    d_loss = float(np.max(np.abs(np.subtract(losses, ref_losses))))
    x = data[0][0]
    d_apply = float(np.abs(np.asarray(model.apply({"params": state.params}, x))
                           - np.asarray(model.apply({"params": ref.params}, x))).max())
    print(f"Linen stage 3, {kind}, {opt_name}, {devices} devices: |params| = {d_params:.2e}, |losses| = "
          f"{d_loss:.2e}, |apply outside the step| = {d_apply:.2e}")
    assert d_params < 1e-6 and d_loss < 1e-6 and d_apply < 1e-6
    assert fleet.check_replicas(state) == []


def test_stage_3_equals_the_single_device_step(make_world):
    """Directly against ``nnx.jit`` on one device (a CNN: 4-d kernels, uneven chunks)."""
    data = models.batches("cnn", 6, 16)
    ref_losses, ref_params = models.nnx_reference("cnn", data, optax.adam(1e-2))
    make_world(4, strategy(3))
    model, opt, _, losses = train_nnx("cnn", data, optax.adam(1e-2))
    d_params = models.max_diff(models.flat_params(model), ref_params)
    d_loss = float(np.max(np.abs(np.subtract(losses, ref_losses))))
    print(f"stage 3 CNN vs one device: |params| = {d_params:.2e}, |losses| = {d_loss:.2e}")
    assert d_params < 1e-5 and d_loss < 1e-5
    assert len(sharded_params(model)) == 6


@pytest.mark.parametrize("sections", [
    pytest.param({"amp": True, "amp_configs": {"dtype": "bfloat16"}}, id="amp_bf16"),
    pytest.param({"amp": True, "amp_configs": {"dtype": "float16"}}, id="amp_fp16",
                 marks=tiers.slow),
    pytest.param({"recompute": True, "recompute_configs": {"checkpoints": ["conv1", "conv2"]}},
                 id="recompute"),
    pytest.param({"check_nan_inf": True}, id="check_nan_inf"),
    pytest.param({"fp16_allreduce": True}, id="fp16_allreduce", marks=tiers.slow),
    pytest.param({"verify_steps": 2}, id="verify_steps", marks=tiers.slow),
])
def test_sections_compose_with_stage_3(sections):
    data = models.batches("cnn", 6, 16)
    d_params, d_state, d_loss, model, opt = compare("cnn", data, OPTIMIZERS["adam"], 4,
                                                    **sections)
    print(f"stage 3 + {sorted(sections)}: |params| = {d_params:.2e}, |opt state| = "
          f"{d_state:.2e}, |losses| = {d_loss:.2e}")
    assert d_params < 1e-6 and d_state < 1e-6 and d_loss < 1e-6
    assert len(sharded_params(model)) == 6
    assert_replicated_state_equal(opt)


@pytest.mark.parametrize("sync_batch_norm", [True, pytest.param(False, marks=tiers.slow)])
def test_batch_norm_statistics_stay_whole_and_replicated_under_stage_3(make_world,
                                                                        sync_batch_norm):
    """A model with nnx.BatchNorm: its parameters split, its statistics (not the
    optimizer's) whole and replicated, both equal to the unsharded run."""
    from tests import test_batch_norm as bn

    runs = {}
    for stage in (0, 3):
        make_world(4, strategy(stage, sync_batch_norm=sync_batch_norm))
        runs[stage] = train_nnx(None, bn.data(), optax.sgd(bn.LR), bn.train_step,
                                model=bn.Net(nnx.Rngs(0)))
    (model, opt, _, losses), (ref, _, _, ref_losses) = runs[3], runs[0]
    stats = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.BatchStat))}
    ref_stats = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(ref, nnx.BatchStat))}
    d_params = models.max_diff(models.flat_params(model), models.flat_params(ref))
    d_stats = models.max_diff(stats, ref_stats)
    d_loss = float(np.max(np.abs(np.subtract(losses, ref_losses))))
    print(f"stage 3, BatchNorm (sync_batch_norm={sync_batch_norm}): |params| = {d_params:.2e}, "
          f"|batch stats| = {d_stats:.2e}, |losses| = {d_loss:.2e}")
    assert d_params < 1e-6 and d_stats < 1e-6 and d_loss < 1e-6
    assert len(sharded_params(model)) == 6 and opt.sharded  # (SGD: no state, split params)
    assert fleet.check_replicas(model) == []


@tiers.slow
def test_optax_multi_steps_composes_with_stage_3():
    """What the gradient-merge refusal proposes: optax.MultiSteps in the optimizer."""
    data = models.batches("linear", 8, 16)
    d_params, d_state, _, _, opt = compare(
        "linear", data, lambda: optax.MultiSteps(optax.adam(1e-2), 2), 4)
    print(f"stage 3 + optax.MultiSteps(k=2): |params| = {d_params:.2e}, |opt state| = "
          f"{d_state:.2e}")
    assert d_params < 1e-6 and d_state < 1e-6


def test_fleet_model_with_stage_3_equals_the_low_level_loop(make_world, tmp_path):
    model, ref, data, d = fleet_model_and_the_loop(make_world, 3, 4)
    assert d < 1e-6 and len(sharded_params(model.network)) == 6
    # Outside a step it reads as the user's model (acceptance 3).
    summary = model.summary()
    assert summary["total_params"] == sum(v.size for v in models.flat_params(ref).values())
    x = data[0][0]
    eval_out = np.asarray(model.network(x))  # whole parameters, gathered at each read
    np.testing.assert_allclose(eval_out, np.asarray(ref(x)), atol=1e-6)
    model.save(str(tmp_path / "infer"), training=False)
    np.testing.assert_allclose(np.asarray(fleet.load_inference(tmp_path / "infer")(x)), eval_out,
                               atol=1e-6)
    fleet.save(model.network.state_dict(), str(tmp_path / "net.pdparams"))
    loaded = {k: np.asarray(v) for k, v in fleet.load(str(tmp_path / "net.pdparams")).items()}
    expected = {k: np.asarray(v) for k, v in ref.state_dict().items()}
    assert {k: v.shape for k, v in loaded.items()} == {k: v.shape for k, v in expected.items()}
    assert models.max_diff(loaded, expected) < 1e-6


# -- refusals -----------------------------------------------------------------------------------

def _no_sync_call(model, opt, step, x, y):
    with model.no_sync():
        step(model, opt, x, y)


@pytest.mark.parametrize("what, match", [
    ("no_sync", r"stage = 3 with no_sync: .*use sharding_configs.stage = 2 with no_sync"),
    ("gradient_merge", r"stage = 3 with gradient_merge: .*optax.MultiSteps"),
    ("linen", r"stage = 3 with parameters fleet did not split: a Linen model's parameters "
              r"are split by the wrapped model's init"),
    ("unwrapped", r"stage = 3 splits the parameters of a model wrapped by "
                  r"fleet.distributed_model, and LinearNet's parameter '_linear1.bias'"),
])
def test_what_stage_3_does_not_compose_with_is_refused_by_name(make_world, what, match):
    data = models.batches("linear", 1, 16)
    x, y = data[0]
    sections = {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}} if (
        what == "gradient_merge") else {}
    make_world(4, strategy(3, **sections))
    with pytest.raises(fleet.FleetUnsupportedError, match=match):
        if what == "linen":  # parameters from the plain module's init
            TrainState.create(apply_fn=fleet.distributed_model(models.LinenLinearNet()).apply,
                              params=models.linen_init("linear", data)["params"],
                              tx=fleet.distributed_optimizer(optax.adam(1e-2)))
        elif what == "unwrapped":
            model = models.LinearNet(nnx.Rngs(0))
            opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2),
                                                            wrt=nnx.Param))
            fleet.distributed_step(models.nnx_train_step)(model, opt, x, y)
        else:
            model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
            opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2),
                                                            wrt=nnx.Param))
            _no_sync_call(model, opt, fleet.distributed_step(models.nnx_train_step), x, y)


# -- acceptance 4: checkpoints across replica counts and stages -----------------------------------

@pytest.mark.parametrize("saved", [(4, 3), pytest.param((4, 2), marks=tiers.slow),
                                   pytest.param((1, 0), marks=tiers.slow)])
def test_checkpoints_move_between_stage_3_replica_counts_and_stages(make_world, tmp_path, saved):
    """Saved at stage 3 on 4 devices, restored on 2 (stage 3), on 1 unsharded, under
    stage 2 and on 4 unsharded; and back: saved at stage 2 or on one device,
    restored at stage 3. The restored state is bitwise the saved one, and 6 more
    steps give the straight run's parameters. ``fleet.save`` of the state dict
    holds the whole parameters, and ``set_state_dict`` splits them again."""
    data = models.batches("cnn", 12, 16)
    make_world(saved[0], strategy(saved[1]))
    model, opt, step, _ = train_nnx("cnn", data[:6], optax.adam(1e-2))
    saved_state = logical_opt_state(opt)
    saved_params = models.flat_params(model)
    with fleet.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(6, model=model, optimizer=opt)
    fleet.save(model.state_dict(), str(tmp_path / "model.pdparams"))
    for x, y in data[6:]:
        step(model, opt, x, y)
    straight = models.flat_params(model)
    if saved[1] == 3:  # restored into the running stage-3 model: its slices set again
        with fleet.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
            manager.restore(6, model=model, optimizer=opt)
        assert models.max_diff(models.flat_params(model), saved_params) == 0
        assert models.max_diff(logical_opt_state(opt), saved_state) == 0
        model.set_state_dict(fleet.load(str(tmp_path / "model.pdparams")))
        assert models.max_diff(models.flat_params(model), saved_params) == 0
        assert len(sharded_params(model)) == 6
    targets = [(2, 3), (1, 0), (4, 2)] if saved == (4, 3) else [(4, 3), (2, 3)]
    assert_restores(make_world, tmp_path, saved, targets, data[6:], saved_state, straight)


def _decayed_step(model, optimizer, x, y):
    def loss_fn(m):
        return models.loss_of(m(x), y) + 1e-2 * jax.numpy.sum(m._linear1.kernel[...] ** 2)

    optimizer.update(model, nnx.grad(loss_fn)(model))
    return models.loss_of(model(x), y)  # (the model called again: gathered again, whole)


@pytest.mark.parametrize("stage", [pytest.param(2, marks=tiers.slow), 3])
def test_a_parameter_read_outside_call_is_gathered_once(stage):
    """A weight decay term reads a parameter outside ``__call__``: one gradient per
    parameter reaches the optimizer (stages 2 and 3 refused this step before,
    saying the gradient had been changed after nnx.grad)."""
    data = models.batches("linear", 6, 16)
    d_params, d_state, d_loss, _, _ = compare("linear", data, OPTIMIZERS["adam"], 4, stage=stage,
                                              step_fn=_decayed_step)
    print(f"stage {stage}, weight decay read outside __call__: |params| = {d_params:.2e}, "
          f"|opt state| = {d_state:.2e}, |losses| = {d_loss:.2e}")
    assert d_params < 1e-6 and d_state < 1e-6 and d_loss < 1e-6


@tiers.slow
def test_a_linen_train_state_moves_between_stage_3_and_stage_2(make_world, tmp_path):
    """A TrainState saved at stage 3 on 4 devices restores, bitwise, into stage 2 on
    2 devices and into stage 3 on 2 devices (whose parameters are Shards again)."""
    data = models.batches("linear", 4, 16)
    make_world(4, strategy(3))
    _, state, _ = train_linen("linear", data, optax.adam(1e-2))
    with fleet.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(4, state=state)
    saved = models.flat_params(_stage3.whole_params({"p": state.params, "o": state.opt_state}))
    for stage in (2, 3):
        make_world(2, strategy(stage))
        _, target, _ = train_linen("linear", data, optax.adam(1e-2), steps=0)
        with fleet.checkpoint.CheckpointManager(tmp_path / "ckpt") as manager:
            got = manager.restore(4, state=target).state
        assert all(map(_sharding.is_shard, jax.tree.leaves(got.params, is_leaf=_sharding.is_shard))
                   ) == (stage == 3)
        flat = models.flat_params(_stage3.whole_params({"p": got.params, "o": got.opt_state}))
        assert flat.keys() == saved.keys()
        assert all(np.array_equal(flat[k], saved[k]) for k in saved), stage


# -- Paddle's spelling -----------------------------------------------------------------------------

def test_group_sharded_parallel_p_g_os_is_stage_3(make_world):
    """``fleet.group_sharded_parallel(model, opt, "p_g_os")`` after a plain
    ``fleet.init``: the same run as ``sharding_configs = {"stage": 3}``."""
    data = models.batches("linear", 6, 16)
    make_world(4, strategy(3))
    ref, _, _, _ = train_nnx("linear", data, optax.adam(1e-2))
    make_world(4, strategy())
    model = models.LinearNet(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    model, opt, scaler = fleet.group_sharded_parallel(model, opt, "p_g_os")
    assert scaler is None and fleet.world().strategy.sharding_configs.stage == 3
    step = fleet.distributed_step(models.nnx_train_step)
    for x, y in data:
        step(model, opt, x, y)
    assert len(sharded_params(model)) == 4 and opt.sharded
    assert models.max_diff(models.flat_params(model), models.flat_params(ref)) == 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"level": "p_g"}, fleet.FleetConfigError, r"level must be one of \['os', 'os_g', 'p_g_os'\]"),
    ({"level": "os", "offload": True}, fleet.FleetUnsupportedError,
     r"group_sharded_parallel\(offload=...\) is not supported"),
    ({"level": "os_g", "segment_size": 0}, fleet.FleetConfigError,
     r"segment_size must be a positive number of bytes, got 0"),
])
def test_group_sharded_parallel_refuses_what_it_cannot_run(make_world, kwargs, error, match):
    make_world(4, strategy())
    model = models.LinearNet(nnx.Rngs(0))
    with pytest.raises(error, match=match):
        fleet.group_sharded_parallel(model, optax.adam(1e-2), **kwargs)


def _raw_norm_step(model, optimizer, x, y):
    models.nnx_train_step(model, optimizer, x, y)
    return optax.tree.norm(nnx.state(model, nnx.Param))  # (the raw values: slices)


def _read_norm_step(model, optimizer, x, y):
    models.nnx_train_step(model, optimizer, x, y)
    variables = jax.tree.leaves(nnx.state(model, nnx.Param),
                                is_leaf=lambda v: isinstance(v, nnx.Variable))
    return sum(jax.numpy.sum(v[...] ** 2) for v in variables)  # (reads: gathered whole)


def test_a_norm_of_the_read_parameters_is_whole_and_of_the_raw_slices_is_refused(make_world):
    """Reading ``v[...]`` in the step gathers the whole parameter, invariant: the
    sum of squares equals the unsharded step's. The raw leaves are slices: such an
    output differs across replicas, and the refusal says where it comes from."""
    data = models.batches("linear", 2, 16)
    got = {}
    for stage in (0, 3):
        make_world(4, strategy(stage))
        _, _, _, got[stage] = train_nnx("linear", data, optax.adam(1e-2), _read_norm_step)
    print(f"sum of squared parameters after each step, stage 0 {got[0]}, stage 3 {got[3]}")
    np.testing.assert_allclose(got[3], got[0], rtol=1e-6)
    with pytest.raises(fleet.FleetError, match=r"not a mean, a sum.*Under sharding_configs.stage"
                                               r" = 3 a parameter's raw value .*read "
                                               r"variable\[\.\.\.\] instead"):
        train_nnx("linear", data, optax.adam(1e-2), _raw_norm_step)
