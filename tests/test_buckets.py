"""Acceptance: buckets are real. The traced step holds exactly one gradient psum
per bucket (one per leaf with fusion off), and results stay equivalent."""

import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from fleet.comm import _hooks
from fleet.comm._buckets import MB, BucketConfig, plan_buckets, reduce_buckets
from fleet.comm._shard_comm import ReduceScatter
from tests import models
from tests.jaxpr_utils import count_buckets, count_primitives


class Deep(nnx.Module):
    """Four Linear(256, 256): leaves in order b1, k1, b2, k2, ... of 1 KiB and 256 KiB."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(256, 256, rngs=rngs)
        self.l2 = nnx.Linear(256, 256, rngs=rngs)
        self.l3 = nnx.Linear(256, 256, rngs=rngs)
        self.l4 = nnx.Linear(256, 256, rngs=rngs)

    def __call__(self, x):
        return self.l4(nnx.relu(self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))))


B, K = 1024, 256 * 1024  # bytes of a bias and of a kernel


@pytest.mark.parametrize(
    "nbytes, comm, last, expected",
    [
        ([B, K] * 4, 25, 1, [[0, 1, 2, 3, 4, 5, 6], [7]]),  # 6 leaves + b4 fit in 1 MB
        ([B, K] * 4, 0.25, 0.25, [[i] for i in range(8)]),  # K alone fills a bucket
        ([B, K] * 4, 0.6, 0.3, [[0, 1, 2], [3, 4, 5, 6], [7]]),
        ([3 * MB], 1, 1, [[0]]),  # a leaf larger than the cap gets its own bucket
        ([], 25, 1, []),
    ],
)
def test_plan_buckets(nbytes, comm, last, expected):
    assert plan_buckets(nbytes, BucketConfig(comm, last)) == expected


def test_no_fusion_is_one_bucket_per_leaf():
    assert plan_buckets([B, K, B], BucketConfig(25, 1, fuse=False)) == [[0], [1], [2]]


@pytest.mark.parametrize(
    "comm, last, fuse, expected_buckets",
    [(25, 1, True, 2), (0.25, 0.25, True, 8), (0.6, 0.3, True, 3), (25, 1, False, 8),
     (100, 100, True, 1)],
)
def test_traced_step_has_one_psum_per_bucket(make_world, comm, last, fuse, expected_buckets):
    strategy = fleet.DistributedStrategy(
        fuse_grad_size_in_MB=comm, last_comm_group_size_MB=last, fuse_all_reduce_ops=fuse
    )
    make_world(4, strategy)
    rng = np.random.RandomState(0)
    x, y = rng.randn(8, 256).astype(np.float32), rng.randn(8, 256).astype(np.float32)

    reference = Deep(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    nnx.jit(models.nnx_train_step)(reference, ref_opt, x, y)

    model = fleet.distributed_model(Deep(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    jaxpr = step.make_jaxpr(model, optimizer, x, y)
    assert count_buckets(jaxpr) == expected_buckets
    assert count_primitives(jaxpr) == 8  # each of Deep's 8 gradient leaves reduced once
    step(model, optimizer, x, y)
    assert models.max_diff(models.flat_params(model), models.flat_params(reference)) < 1e-5


def test_data_parallel_arguments_set_the_buckets(make_world):
    make_world(2)
    model = fleet.DataParallel(Deep(nnx.Rngs(0)), comm_buffer_size=0.25, last_comm_buffer_size=0.25)
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    x = np.ones((4, 256), np.float32)
    jaxpr = fleet.distributed_step(models.nnx_train_step).make_jaxpr(model, optimizer, x, x)
    assert count_buckets(jaxpr) == 8
    assert count_primitives(jaxpr) == 8


def test_plan_breaks_where_the_kind_changes():
    """ZeRO's all-gather plans with the one planner, one dtype per bucket."""
    kinds = ["float32", "float32", "bfloat16", "float32"]
    assert plan_buckets([B] * 4, BucketConfig(1, 1), kinds) == [[0, 1], [2], [3]]
    assert plan_buckets([B] * 4, BucketConfig(1, 1)) == [[0, 1, 2, 3]]


def test_the_loop_calls_the_hook_once_per_bucket_in_plan_order():
    seen = []

    def hook(bucket, leaves):
        seen.append((bucket.index, bucket.members, list(leaves)))
        return [x * 10 for x in leaves]

    out = reduce_buckets([[3, 1], [0]], [1, 2, 3, 4, 5], hook)
    assert out == [10, 20, 3, 40, 5]  # leaf 2 and 4 are in no bucket: unchanged
    assert seen == [(0, (3, 1), [4, 2]), (1, (0,), [1])]


def test_the_strategy_picks_the_hook():
    divisor = np.float32(2)
    assert _hooks.gradient_hook(None) is _hooks.mean_all_reduce
    assert _hooks.gradient_hook("bfloat16") == _hooks.fp16_compress("bfloat16")
    assert _hooks.gradient_hook(None, divisor) == _hooks.Divided(_hooks.mean_all_reduce, divisor)
    assert _hooks.gradient_hook("float16", shard="cfg") == ReduceScatter("cfg")
