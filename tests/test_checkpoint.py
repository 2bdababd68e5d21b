"""fleet.save / fleet.load and CheckpointManager in one process: keep-last-K,
intervals, asynchronous saves, Linen state, metadata, mismatches (acceptance 5),
and loading that never runs code."""

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training.train_state import TrainState

import fleet
from fleet.checkpoint import CheckpointManager, FleetCheckpointError, load, save
from tests import models
from tests.test_checkpoint_file import rewrite
from tests.test_first_trace import compiles_during
from tests.workers import ckpt_common

OLD_SAVE = Path(__file__).parent / "data/checkpoint/fleet_save_directory_format.pdparams"

@pytest.fixture
def job(make_world):
    make_world(4)
    return ckpt_common.build()


def saved_steps(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


# -- fleet.save / fleet.load ------------------------------------------------------------------

def test_save_load_state_dict_round_trip(job, tmp_path):
    ckpt_common.train(job, 2)
    state = job.model.state_dict()
    save(state, tmp_path / "model.pdparams")
    loaded = load(tmp_path / "model.pdparams")
    assert sorted(loaded) == sorted(state)
    for key, value in state.items():
        assert type(loaded[key]) is np.ndarray and loaded[key].dtype == value.dtype
        np.testing.assert_array_equal(loaded[key], value)
    fresh = ckpt_common.build()
    fresh.model.set_state_dict(loaded)  # keys, shapes and dtypes fit
    ckpt_common.assert_bitwise_equal(fresh.model.state_dict(), state)


def test_save_nested_values_and_replace(tmp_path, make_world):
    make_world(2)
    path = tmp_path / "opt.pdopt"
    obj = {"w": jax.device_put(np.arange(6.0).reshape(2, 3), fleet.world().replicated),
           "lr": 0.5, "epoch": 3, "name": "adam", "list": [np.ones(2, np.int32), 7],
           "key": jax.random.key(1)}
    save({"old": np.zeros(3)}, path)
    save(obj, path)  # replaces the old one once the new one is complete
    loaded = load(path)
    assert sorted(loaded) == ["epoch", "key", "list", "lr", "name", "w"]
    np.testing.assert_array_equal(loaded["w"], np.arange(6.0).reshape(2, 3))
    assert (loaded["lr"], loaded["epoch"], loaded["name"]) == (0.5, 3, "adam")
    np.testing.assert_array_equal(loaded["list"][0], np.ones(2, np.int32))
    assert loaded["list"][1] == 7
    np.testing.assert_array_equal(loaded["key"], jax.random.key_data(jax.random.key(1)))
    assert sorted(os.listdir(tmp_path)) == ["opt.pdopt"]  # no temporary leftovers


def test_save_and_load_errors(tmp_path):
    with pytest.raises(FleetCheckpointError, match=r"\['f'\] is a builtin_function_or_method; "
                                                   r"fleet.save takes dicts and lists of arrays.*"
                                                   r"never pickles"):
        save({"f": len}, tmp_path / "x")
    with pytest.raises(FleetCheckpointError, match="does not exist"):
        load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FleetCheckpointError, match="is not a checkpoint written by fleet.save"):
        load(tmp_path / "empty")


# -- loading never executes code --------------------------------------------------------------

class _Boom:
    def __reduce__(self):
        return (open, (os.environ["CKPT_PWNED"], "w"))


def test_loading_never_unpickles(job, tmp_path, monkeypatch):
    """Loading works with pickle disabled, and a pickle planted in a checkpoint is
    refused, not run."""
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        ckpt_common.train(job, 1, manager)
    save(job.model.state_dict(), tmp_path / "model")

    def refuse(*args, **kwargs):
        raise AssertionError("pickle used while loading a checkpoint")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.restore(1, **ckpt_common.build().parts()).step == 1
    assert sorted(load(tmp_path / "model")) == sorted(job.model.state_dict())
    assert sorted(load(OLD_SAVE)["linear"]) == ["bias", "kernel"]  # the earlier fleet.save's
    monkeypatch.undo()

    pwned = tmp_path / "pwned"
    monkeypatch.setenv("CKPT_PWNED", str(pwned))
    payload = pickle.dumps(_Boom())
    (tmp_path / "ckpt/1/meta/metadata").write_bytes(payload)
    rewrite(tmp_path / "model", {"fleet.json": payload})
    with CheckpointManager(tmp_path / "ckpt") as manager, pytest.raises(
            FleetCheckpointError, match="'meta' item is not readable JSON"):
        manager.restore(1, **ckpt_common.build().parts())
    with pytest.raises(FleetCheckpointError, match="model is damaged: its fleet.json cannot be read"):
        load(tmp_path / "model")
    old = tmp_path / "old.pdparams"  # the directory of the earlier fleet.save
    shutil.copytree(OLD_SAVE, old)
    (old / "_METADATA").write_bytes(payload)
    with pytest.raises(FleetCheckpointError, match="is not a checkpoint written by fleet.save"):
        load(old)
    assert not pwned.exists()


# -- keep last K, intervals -------------------------------------------------------------------

def test_keep_last_k_and_save_every_n_steps(job, tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=3) as manager:
        written = [manager.save(step, model=job.model) for step in range(1, 11)]
        assert written == [s % 3 == 0 for s in range(1, 11)]
        assert manager.save(10, model=job.model, force=True)  # the last step, off-interval
        manager.wait_until_finished()
        assert manager.all_steps() == [9, 10] and manager.latest_step() == 10
    assert saved_steps(tmp_path) == [9, 10]


def test_saving_an_existing_step_is_an_error_or_a_forced_overwrite(job, tmp_path):
    with CheckpointManager(tmp_path, save_interval_steps=3) as manager:
        assert manager.save(3, model=job.model, epoch=1)
        with pytest.raises(FleetCheckpointError, match=r"step 3 is already saved in .*; pass "
                                                       r"force=True to overwrite it"):
            manager.save(3, model=job.model, epoch=2)
        assert not manager.save(4, model=job.model)  # off-interval: nothing to refuse
        before = job.model.state_dict()
        ckpt_common.train(job, 1)  # new values
        assert manager.save(3, model=job.model, epoch=3, force=True)  # documented overwrite
        assert manager.all_steps() == [3]
        fresh = ckpt_common.build()
        assert manager.restore(3, model=fresh.model).epoch == 3
    ckpt_common.assert_bitwise_equal(fresh.model.state_dict(), job.model.state_dict())
    assert any(not np.array_equal(before[k], v) for k, v in job.model.state_dict().items())


def test_save_every_n_seconds(job, tmp_path):
    with CheckpointManager(tmp_path, save_interval_seconds=1, async_save=False) as manager:
        assert manager.save(1, model=job.model)  # the first one
        assert not manager.save(2, model=job.model)  # too soon
        time.sleep(1.1)
        assert manager.save(3, model=job.model)
        assert manager.all_steps() == [1, 3]


def test_bad_options(tmp_path):
    with pytest.raises(FleetCheckpointError, match=r"max_to_keep must be an int >= 1 or None, got 0"):
        CheckpointManager(tmp_path / "x", max_to_keep=0)
    with pytest.raises(FleetCheckpointError, match=r"step must be an int >= 0, got -1"):
        CheckpointManager(tmp_path / "x").save(-1)


# -- asynchronous save ------------------------------------------------------------------------

def test_async_save_changes_nothing(job, tmp_path):
    """Training goes on while the saves are written: the results are those of a run
    without checkpoints, and each checkpoint holds the values of its own step,
    bitwise what a synchronous save of the same step writes."""
    reference = ckpt_common.snapshot(ckpt_common.train(ckpt_common.build(), 8))
    with CheckpointManager(tmp_path / "async") as manager, \
         CheckpointManager(tmp_path / "sync", async_save=False) as sync:
        states = {}

        def save_sync_too(j):
            states[j.step] = ckpt_common.snapshot(j)
            sync.save(j.step, **j.parts(), metadata={"job": "ckpt", "step": j.step})

        ckpt_common.train(job, 8, manager, after_step=save_sync_too)
        ckpt_common.assert_bitwise_equal(ckpt_common.snapshot(job), reference)
        assert manager.all_steps() == sync.all_steps() == list(range(1, 9))
        for step in (1, 4):
            for source in (manager, sync):
                job.restore(source, step)
                got = ckpt_common.snapshot(job)
                got.pop("loader")  # reported only once iteration starts (fleet.io)
                ckpt_common.assert_bitwise_equal(got | {"loader": states[step]["loader"]},
                                                 states[step])


# -- what a checkpoint holds ------------------------------------------------------------------

def test_linen_train_state_rng_epoch_and_metadata(make_world, tmp_path):
    make_world(2)
    data = models.batches("linear", 3, 8)
    module = fleet.distributed_model(models.LinenLinearNet())
    params = module.init(jax.random.key(0), data[0][0][:1])["params"]
    state = TrainState.create(apply_fn=module.apply, params=params,
                              tx=fleet.distributed_optimizer(optax.adam(models.LR)))
    step = fleet.distributed_step(models.linen_train_step)
    for x, y in data:
        state, _ = step(state, x, y)
    keys = {"data": jax.random.key(3), "noise": jax.random.split(jax.random.key(4), 2)}
    with CheckpointManager(tmp_path) as manager:
        manager.save(3, state=state, rng=keys, epoch=1,
                     metadata={"loss": np.float32(0.25), "tags": ("a", "b"), "best": None})
        template = TrainState.create(apply_fn=module.apply, params=params,
                                     tx=fleet.distributed_optimizer(optax.adam(models.LR)))
        restored = manager.restore_latest(state=template, rng={"data": jax.random.key(0),
                                                               "noise": jax.random.split(
                                                                   jax.random.key(0), 2)})
    assert (restored.step, restored.epoch) == (3, 1)
    assert restored.metadata == {"loss": 0.25, "tags": ["a", "b"], "best": None}
    assert int(restored.state.step) == 3
    assert models.max_diff(models.flat_params(restored.state.params),
                           models.flat_params(state.params)) == 0
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
                                     restored.state.opt_state, state.opt_state))
    for name in keys:
        np.testing.assert_array_equal(jax.random.key_data(restored.rng[name]),
                                      jax.random.key_data(keys[name]))
    assert restored.state.params["Dense_0"]["kernel"].sharding == fleet.world().replicated


def test_a_state_restored_in_the_process_compiles_nothing_new(make_world, tmp_path):
    """A ``TrainState`` restored into the live one (a rollback, an evaluation of a
    saved step) comes back as the step left it: its ``step`` weakly typed, as the
    compiled program returns it, so the next call finds that program. Orbax reads
    a plain ``int32``, and the call compiled the program again (1 compilation
    before, 0 now)."""
    make_world(2)
    data = models.batches("linear", 2, 8)
    module = fleet.distributed_model(models.LinenLinearNet())
    state = TrainState.create(apply_fn=module.apply,
                              params=module.init(jax.random.key(0), data[0][0][:1])["params"],
                              tx=fleet.distributed_optimizer(optax.adam(models.LR)))
    step = fleet.distributed_step(models.linen_train_step)
    for x, y in data:
        state, _ = step(state, x, y)
    assert jax.typeof(state.step).weak_type  # (what the program returns)
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, state=state)
        restored = manager.restore_latest(state=state).state
    assert jax.typeof(restored.step).weak_type and int(restored.step) == 2
    assert restored.step.sharding == state.step.sharding
    (state, _), compiled = compiles_during(step, restored, *data[0])
    assert compiled == 0 and int(state.step) == 3


def test_metadata_must_be_json(job, tmp_path):
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(FleetCheckpointError, match=r"metadata\['bad'\] is a ndarray; metadata "
                                                       r"is stored as JSON \(never pickled\)"):
            manager.save(1, model=job.model, metadata={"bad": np.zeros(2)})
        with pytest.raises(FleetCheckpointError, match=r"metadata has the key 1 \(int\)"):
            manager.save(1, model=job.model, metadata={1: "x"})
        assert manager.all_steps() == []


def test_model_alone_restores_for_evaluation_and_reads_as_a_state_dict(job, tmp_path):
    ckpt_common.train(job, 2)
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, **job.parts())
        fresh = ckpt_common.build()
        assert manager.restore(2, model=fresh.model).step == 2
    ckpt_common.assert_bitwise_equal(fresh.model.state_dict(), job.model.state_dict())
    ckpt_common.assert_bitwise_equal(load(tmp_path / "2/model"), job.model.state_dict())


def test_a_checkpoint_of_metadata_alone(make_world, tmp_path):
    make_world(1)
    with CheckpointManager(tmp_path) as manager:
        assert manager.save(1, state={}, epoch=2, metadata={"best": float("nan")})
        restored = manager.restore_latest(state={})
    assert restored.state == {} and restored.epoch == 2 and np.isnan(restored.metadata["best"])


def test_nothing_to_restore(job, tmp_path):
    before = ckpt_common.snapshot(job)
    with CheckpointManager(tmp_path) as manager:
        assert manager.restore_latest(**job.parts()) is None
        with pytest.raises(FleetCheckpointError, match=r"no complete checkpoint of step 5 in "
                                                       r".*; saved steps: \[\]"):
            manager.restore(5, model=job.model)
    ckpt_common.assert_bitwise_equal(ckpt_common.snapshot(job), before)


# -- acceptance 5: a checkpoint that does not fit ---------------------------------------------

class OtherNet(nnx.Module):
    """Like ckpt_common.Net, but linear2 has 2 outputs, no batch norm, one more layer."""

    def __init__(self, rngs):
        self.linear1 = nnx.Linear(8, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(16, 2, rngs=rngs)
        self.head = nnx.Linear(2, 1, param_dtype=np.float16, rngs=rngs)


def test_mismatch_lists_every_difference_and_changes_nothing(job, tmp_path):
    ckpt_common.train(job, 3)
    with CheckpointManager(tmp_path) as manager:
        manager.save(3, **job.parts())

    model = fleet.distributed_model(OtherNet(nnx.Rngs(5, dropout=6)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9),
                                                          wrt=nnx.Param))
    other = ckpt_common.build()  # its loader: another batch size
    loader = fleet.io.DataLoader(other.loader.dataset, batch_sampler=fleet.io.DistributedBatchSampler(
        other.loader.dataset, 1, shuffle=True, drop_last=True))
    rng = jax.random.key(0, impl="rbg")
    before = {"model": model.state_dict(), "loader": json.dumps(loader.state_dict()),
              "rng": np.asarray(jax.random.key_data(rng)),
              "optimizer": {str(p): np.asarray(v.get_value())
                            for p, v in nnx.to_flat_state(nnx.state(optimizer))}}
    with CheckpointManager(tmp_path) as manager, pytest.raises(FleetCheckpointError) as info:
        manager.restore(3, model=model, optimizer=optimizer, loader=loader, rng=rng)
    message = str(info.value)
    print(message)
    assert "does not fit what it is restored into" in message and "nothing was changed" in message
    for expected in [
        "model: missing 'head.kernel' (float16[2, 1] here, not in the checkpoint)",
        "model: unexpected 'norm.mean' (float32[16] in the checkpoint, not here)",
        "model: 'linear2.kernel': checkpoint float32[16, 1], here float32[16, 2]",
        "optimizer: missing 'opt_state.0.trace.linear1.bias'",
        "optimizer: unexpected 'opt_state.0.mu.linear1.bias'",
        "rng: 'value': checkpoint uint32[2], here uint32[4]",
        "loader: the sampler state was saved with batch_size=2 but this sampler has batch_size=1",
    ]:
        assert expected in message, expected
    # Nothing changed: not the model, the optimizer, the loader or the key.
    assert json.dumps(loader.state_dict()) == before["loader"]
    ckpt_common.assert_bitwise_equal(model.state_dict(), before["model"])
    ckpt_common.assert_bitwise_equal({str(p): np.asarray(v.get_value())
                                      for p, v in nnx.to_flat_state(nnx.state(optimizer))},
                                     before["optimizer"])


def test_mismatch_of_parts_and_key_kinds(job, tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, model=job.model, rng=jax.random.key_data(jax.random.key(1)))
        with pytest.raises(FleetCheckpointError) as info:
            manager.restore(1, optimizer=job.optimizer, loader=job.loader, rng=jax.random.key(0))
    message = str(info.value)
    assert "optimizer: not in the checkpoint (it holds model, rng)" in message
    assert "loader: the checkpoint holds no loader position (saved without loader=)" in message
    assert ("rng: 'value': checkpoint holds plain data, not a PRNG key, here a "
            "'threefry2x32' PRNG key") in message
