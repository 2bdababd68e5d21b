"""Acceptance: every error path says what was given, what is allowed, what to do."""

import jax
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.nnx import bridge

import fleet
from fleet.runtime import _world
from fleet.runtime._env import WorkerEnv
from tests import models


def test_unknown_strategy_field_names_the_closest():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.FleetAttributeError, match="did you mean 'fuse_grad_size_in_MB'"):
        strategy.fuse_grad_size_in_mb = 16
    with pytest.raises(AttributeError, match="did you mean 'find_unused_parameters'"):
        strategy.find_unused_parameter  # noqa: B018
    assert not hasattr(strategy, "nonsense")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("fuse_all_reduce_ops", 1, "must be of type bool, got 1 of type int"),
        ("fuse_grad_size_in_MB", "16", "must be of type float, got '16' of type str"),
        ("find_unused_parameters", None, "must be of type bool"),
        ("amp", "yes", "must be of type bool"),
        ("amp_configs", 3, "must be a dict or AmpConfigs"),
    ],
)
def test_mistyped_strategy_field(field, value, match):
    with pytest.raises(fleet.FleetTypeError, match=match):
        setattr(fleet.DistributedStrategy(), field, value)


def test_strategy_values_and_configs_are_validated():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.FleetConfigError, match="must be a positive, finite number of MB, got -1"):
        strategy.last_comm_group_size_MB = -1
    with pytest.raises(AttributeError, match="did you mean 'k_steps'"):
        strategy.gradient_merge_configs = {"k_step": 4}
    strategy.gradient_merge_configs = {"k_steps": 4, "avg": False}
    assert strategy.gradient_merge_configs.k_steps == 4
    strategy.fuse_grad_size_in_MB = 16  # an int is a valid float
    assert strategy.fuse_grad_size_in_MB == 16.0


def test_parameter_server_mode_is_refused():
    with pytest.raises(fleet.FleetUnsupportedError, match="is_collective=True"):
        fleet.init(is_collective=False)


@pytest.mark.parametrize("section, instead", [
    ("dgc", "fp16_allreduce"),
    ("localsgd", "gradient_merge"),
    ("pipeline", "recompute"),
    ("tensor_parallel", "jax.sharding"),
])
def test_a_section_fleet_does_not_run_is_refused_with_what_to_use(section, instead):
    # Issue 12 turned amp, recompute, gradient_merge, lars and lamb on, issue 13
    # sharding; these stay refused.
    strategy = fleet.DistributedStrategy()
    setattr(strategy, section, True)
    with pytest.raises(fleet.FleetUnsupportedError,
                       match=f"strategy.{section} = True is not supported: .*{instead}.*"
                             f"strategy.{section} = False"):
        fleet.init(is_collective=True, strategy=strategy)


@pytest.mark.parametrize("section, configs, match", [
    ("amp", {"dtype": "float64"}, "amp_configs.dtype must be one of 'bfloat16', 'float16'"),
    ("amp", {"decr_ratio": 1.5}, "decr_ratio must be below 1"),
    ("amp", {"incr_ratio": 0.5}, "incr_ratio must be a finite number greater than 1.0"),
    ("amp", {"custom_black_list": ["Linear"], "custom_white_list": ["Linear"]},
     "in both custom_white_list and custom_black_list"),
    ("amp", {"use_pure_fp16": True, "use_pure_bf16": True}, "choose one"),
    ("gradient_merge", {"k_steps": 0}, "k_steps must be a finite number greater than 0"),
    ("recompute", {"policy": "everything"}, "policy must be one of 'nothing_saveable'"),
    ("sharding", {"stage": 4}, "sharding_configs.stage must be one of 1, 2, 3, got 4"),  # (3: issue 37)
    ("sharding", {"sharding_degree": -2}, "sharding_degree must be a finite number at least 0"),
    ("sharding", {"segment_broadcast_MB": 0}, "segment_broadcast_MB must be a finite number "
                                              "greater than 0"),
])
def test_section_configs_are_checked_key_by_key(section, configs, match):
    with pytest.raises(fleet.FleetConfigError, match=match):
        setattr(fleet.DistributedStrategy(), f"{section}_configs", configs)


def test_contradicting_sections_are_refused_at_init():
    strategy = fleet.DistributedStrategy(lars=True, lamb=True)
    with pytest.raises(fleet.FleetConfigError, match="lars and strategy.lamb are both on"):
        fleet.init(is_collective=True, strategy=strategy)
    strategy = fleet.DistributedStrategy(recompute=True)
    with pytest.raises(fleet.FleetConfigError, match="names no sub-module.*'checkpoints'"):
        fleet.init(is_collective=True, strategy=strategy)


def test_using_fleet_before_init():
    _world._WORLD = None
    with pytest.raises(fleet.FleetNotInitializedError, match=r"call fleet.init\(is_collective=True\)"):
        fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))


@pytest.fixture
def trained(make_world):
    make_world(4)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    return model, optimizer


def test_batch_that_does_not_divide_over_replicas(trained):
    model, optimizer = trained
    step = fleet.distributed_step(models.nnx_train_step)
    x, y = np.ones((6, 10), np.float32), np.ones((6, 1), np.float32)
    with pytest.raises(fleet.FleetConfigError,
                       match=r"shape \(6, 10\).*not a multiple of the 4 replicas.*multiple of 4"):
        step(model, optimizer, x, y)


def test_reducing_gradients_outside_a_step(trained):
    model, optimizer = trained
    grads = nnx.grad(lambda m: models.loss_of(m(np.ones((4, 10), np.float32)),
                                              np.ones((4, 1), np.float32)))(model)
    with pytest.raises(fleet.FleetError, match=r"inside a step.*@fleet.distributed_step"):
        optimizer.update(model, grads)
    with pytest.raises(fleet.FleetError, match="4 data-parallel replicas"):
        fleet.fused_allreduce_gradients(grads)


def test_reducing_outside_a_step_is_fine_with_one_replica(make_world):
    make_world(1)
    grads = {"w": jax.numpy.ones(3)}
    assert fleet.fused_allreduce_gradients(grads) is grads


def test_wrong_kinds_of_model_and_optimizer(make_world):
    make_world(2)
    with pytest.raises(fleet.FleetTypeError, match="takes a Flax NNX or Linen module, got dict"):
        fleet.DataParallel({"w": 1})
    dp = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    with pytest.raises(fleet.FleetTypeError, match="already a fleet.DataParallel"):
        fleet.DataParallel(dp)
    with pytest.raises(fleet.FleetTypeError, match="optax.GradientTransformation or an nnx.Optimizer"):
        fleet.distributed_optimizer("adam")
    with pytest.raises(fleet.FleetConfigError, match="comm_buffer_size must be a positive, finite number"):
        fleet.DataParallel(models.LinearNet(nnx.Rngs(0)), comm_buffer_size=0)


def test_returning_an_nnx_object_from_a_step(trained):
    model, _ = trained

    @fleet.distributed_step
    def step(model, x):
        return model

    with pytest.raises(fleet.FleetTypeError, match="updated in place, so return only arrays"):
        step(model, np.ones((4, 10), np.float32))


def test_bad_worker_environment(monkeypatch):
    monkeypatch.setenv("FLEET_WORLD_SIZE", "2")
    monkeypatch.setenv("FLEET_RANK", "5")
    with pytest.raises(fleet.FleetConfigError, match=r"rank 5 is outside the job's 2 processes"):
        WorkerEnv.from_environ()
    monkeypatch.setenv("FLEET_RANK", "one")
    with pytest.raises(fleet.FleetConfigError, match="FLEET_RANK='one' is not an integer"):
        WorkerEnv.from_environ()


def test_unhashable_static_argument(trained):
    model, _ = trained

    @fleet.distributed_step
    def step(model, x, names):
        return model(x).mean()

    with pytest.raises(fleet.FleetTypeError, match="static value.*not hashable.*a tuple instead"):
        step(model, np.ones((4, 10), np.float32), ["a", "b"])


def test_joining_a_job_after_computing_says_to_move_fleet_init(monkeypatch):
    """JAX joins a job only before its first computation: fleet.init checks that
    itself (fleet/_compat.py) before it calls jax.distributed.initialize."""
    jax.numpy.ones(2).block_until_ready()  # this process has computed
    monkeypatch.setenv("FLEET_WORLD_SIZE", "2")
    monkeypatch.setenv("FLEET_RANK", "1")
    monkeypatch.setenv("FLEET_COORDINATOR", "127.0.0.1:1")
    _world._WORLD = None
    try:
        with pytest.raises(fleet.FleetConfigError,
                           match=r"fleet.init must run before any JAX computation in a "
                                 r"multi-process job \(this process, rank 1 of 2, has computed "
                                 r"already\); move fleet.init\(is_collective=True\) to the top"):
            fleet.init(is_collective=True)
        assert not jax.distributed.is_initialized()
    finally:
        _world._WORLD = None


def test_a_linen_module_converted_by_the_bridge_is_refused_naming_the_linen_path(make_world):
    """nnx.bridge.ToNNX (Flax's bridge guide) failed inside fleet's wrapping with the
    bridge's own errors ("Cannot infer collection name from value: None", "Type
    SyncedParam is not registered"), blamed on the step; it is refused at the
    wrapping, naming the module and the Linen path, which trains as on one device
    (tests/test_contract.py)."""

    class Outer(nnx.Module):
        def __init__(self, rngs):
            self.net = bridge.ToNNX(linen.Dense(1), rngs=rngs)

    make_world(2)
    dense = bridge.ToNNX(linen.Dense(1), rngs=nnx.Rngs(0))
    bridge.lazy_init(dense, np.ones((2, 3), np.float32))
    with pytest.raises(fleet.FleetTypeError, match=r"converted by flax.nnx.bridge.ToNNX \(Dense\)"
                                                   r".*fleet.distributed_model\(linen_module\)"):
        fleet.distributed_model(dense)
    outer = Outer(nnx.Rngs(0))
    bridge.lazy_init(outer.net, np.ones((2, 3), np.float32))
    with pytest.raises(fleet.FleetTypeError, match=r"ToNNX at net \(Dense\)"):
        fleet.distributed_model(outer)
