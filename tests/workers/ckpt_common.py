"""The training job the checkpoint tests interrupt and resume.

Shared by the test process and the worker scripts, so every run trains the very
same job: a small NNX net with batch norm and dropout (model state beyond the
parameters, an RNG stream inside the model), Adam, a shuffling
``DistributedBatchSampler`` of 5 global batches per epoch (so step 7 is in the
middle of the second epoch), and a PRNG key the loop splits every step (the
script's own RNG state): each step's loss is scaled by a number drawn from it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import fleet
from fleet.io import DataLoader, DistributedBatchSampler, TensorDataset

GLOBAL_BATCH, SAMPLES = 8, 40  # 5 batches per epoch


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.norm(self.linear1(x)))))


def train_step(model, optimizer, x, y, scale):
    loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean() * scale)(model)
    optimizer.update(model, grads)
    return loss


@dataclasses.dataclass
class Job:
    model: Any
    optimizer: Any
    loader: Any
    rng: Any
    step_fn: Any
    step: int = 0
    batches: Any = None  # the running epoch's iterator

    def next_batch(self):
        """The next batch, going on to the next epoch at the end of one (a new
        iterator of the loader starts a new epoch, or resumes a restored one)."""
        while True:
            if self.batches is None:
                self.batches = iter(self.loader)
            try:
                return next(self.batches)
            except StopIteration:
                self.batches = None

    def parts(self) -> dict:
        """What a checkpoint holds (the keyword arguments of save / restore)."""
        return dict(model=self.model, optimizer=self.optimizer, loader=self.loader, rng=self.rng)

    def restore(self, manager, step=None) -> None:
        parts = self.parts()
        restored = (manager.restore_latest(**parts) if step is None
                    else manager.restore(step, **parts))
        if restored is not None:
            self.rng, self.step, self.batches = restored.rng, restored.step, None
            assert restored.metadata == {"job": "ckpt", "step": restored.step}, restored


def build() -> Job:
    """A fresh job on the current fleet world (every process builds the same)."""
    rs = np.random.RandomState(0)
    xs = rs.randn(SAMPLES, 8).astype(np.float32)
    ys = (xs @ rs.randn(8, 1)).astype(np.float32)
    model = Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    strategy = fleet.world().strategy
    if strategy.sync_batch_norm is None:
        # Net's BatchNorm: per-replica statistics, as these checkpoint tests were
        # written. linear1.bias sits right before it, so its true gradient is zero
        # and Adam turns its rounding noise into whole steps; with global-batch
        # statistics that noise depends on how the replicas' all-reduce is laid
        # out over processes, and one step after a restore on another layout no
        # longer agrees to 1e-6 (tests/test_batch_norm.py checks sync itself).
        strategy.sync_batch_norm = False
    model = fleet.distributed_model(model)
    optimizer = fleet.distributed_optimizer(optimizer)
    dataset = TensorDataset([xs, ys])
    sampler = DistributedBatchSampler(dataset, GLOBAL_BATCH // fleet.num_replicas(),
                                      shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_sampler=sampler)
    return Job(model, optimizer, loader, jax.random.key(7), _step_fn())


_STEPS: dict = {}


def _step_fn():
    """One distributed step per fleet world, so a second job reuses its compilation."""
    world = fleet.world()
    if id(world) not in _STEPS:
        _STEPS[id(world)] = (world, fleet.distributed_step(train_step))
    return _STEPS[id(world)][1]


def train(job: Job, until: int, manager=None, after_step=None) -> Job:
    """Trains from ``job.step`` to step ``until``, saving through ``manager`` after
    every step (its interval decides) and calling ``after_step(job)``."""
    while job.step < until:
        x, y = job.next_batch()
        job.rng, sub = jax.random.split(job.rng)
        job.step_fn(job.model, job.optimizer, x, y, float(jax.random.uniform(sub)) + 0.5)
        job.step += 1
        if manager is not None:
            manager.save(job.step, **job.parts(), metadata={"job": "ckpt", "step": job.step})
        if after_step is not None:
            after_step(job)
    return job


def _host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(x.addressable_shards[0].data)
    return np.asarray(x)


def snapshot(job: Job) -> dict[str, np.ndarray]:
    """Everything that must match: model and optimizer variables, RNG, position."""
    out = {f"model/{k}": v for k, v in job.model.state_dict().items()}
    for path, var in nnx.to_flat_state(nnx.state(job.optimizer)):
        out["optimizer/" + ".".join(map(str, path))] = _host(var.get_value())
    out["rng"] = _host(job.rng)
    out["step"] = np.array(job.step)
    out["loader"] = np.array(json.dumps(job.loader.state_dict(), sort_keys=True))
    return out


def assert_bitwise_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for key in want:
        a, b = np.asarray(got[key]), np.asarray(want[key])
        assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, a.shape, b.dtype, b.shape)
        assert a.tobytes() == b.tobytes(), f"{key} differs: {a} vs {b}"
