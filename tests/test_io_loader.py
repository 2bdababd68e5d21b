"""fleet.io.DataLoader: sharded global batches, workers, failures, resume, exact evaluation."""

import json
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import threading

import jax
import numpy as np
import psutil
import pytest

import fleet
from fleet.io import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedBatchSampler,
    FleetDataError,
    FleetWorkerError,
    TensorDataset,
    get_worker_info,
)
from fleet.runtime import _world

# ----------------------------------------------------------------------------- datasets
# Module level, so spawned workers can unpickle them.


class ArrayDataset(Dataset):
    """Per-sample access only (no get_batch): the generic path."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class FlipDataset(Dataset):
    """A deterministic per-sample transform, as augmentation would be."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert type(i) is int, type(i)  # Paddle passes Python ints
        image = np.arange(12, dtype=np.float32).reshape(3, 4) + 100 * i
        return {"image": image[:, ::-1] if i % 2 else image, "label": np.int32(i)}


class FailingDataset(Dataset):
    def __init__(self, n, bad):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"bad sample {i}")
        return np.float32(i)


class RaggedDataset(Dataset):
    def __init__(self, n, odd_one):
        self.n, self.odd_one = n, odd_one

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.zeros(3 if i == self.odd_one else 2, np.float32), i


class WorkerIdDataset(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        info = get_worker_info()
        return np.int64(info.id), np.int64(info.num_workers), np.int64(os.getpid())


class NoPerSampleAccess(TensorDataset):
    def __getitem__(self, i):
        raise AssertionError("the fast path must not call __getitem__")


class RecordingDataset(TensorDataset):
    """Signals when the loader fetches the second batch (to observe prefetching)."""

    def __init__(self, arrays):
        super().__init__(arrays)
        self.fetched = []
        self.second_batch_fetched = threading.Event()

    def get_batch(self, indices):
        self.fetched.append(list(indices))
        if len(self.fetched) == 2:
            self.second_batch_fetched.set()
        return super().get_batch(indices)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def make_world():
    def make(n):
        _world._WORLD = None
        return fleet.init(devices=jax.devices()[:n])

    yield make
    _world._WORLD = None


@pytest.fixture
def no_world():
    _world._WORLD = None
    yield
    _world._WORLD = None


@pytest.fixture
def no_leftover_children():
    """Asserts that the test leaves no child process behind (beyond those it found)."""
    multiprocessing.resource_tracker.ensure_running()  # stdlib's, lives as long as we do
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    after = {p.pid for p in me.children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}
    assert after <= before, f"child processes left behind: {sorted(after - before)}"


def data(n, width=3):
    x = np.arange(n * width, dtype=np.float32).reshape(n, width)
    return x, np.arange(n, dtype=np.int32)


def as_numpy(batch):
    return jax.tree_util.tree_map(np.asarray, batch)


def assert_batches_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(w)
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------- acceptance 7


@pytest.mark.parametrize("num_devices", [1, 2, 8])
@pytest.mark.parametrize("shuffle,drop_last", [(False, False), (True, True), (True, False)])
def test_batches_are_global_arrays_and_each_device_holds_its_replica(
        make_world, num_devices, shuffle, drop_last):
    world = make_world(num_devices)
    n, bs = 53, 3
    x, y = data(n)
    loader = DataLoader(TensorDataset([x, y]), batch_size=bs, shuffle=shuffle,
                        drop_last=drop_last)
    replicas = [DistributedBatchSampler(range(n), bs, num_replicas=num_devices, rank=r,
                                        shuffle=shuffle, drop_last=drop_last)
                for r in range(num_devices)]
    for _epoch in range(2):
        want = list(zip(*[list(s) for s in replicas]))
        got = list(loader)
        assert len(got) == len(want) == len(loader)
        for (xb, yb), per_replica in zip(got, want):
            rows = sum(len(b) for b in per_replica)
            assert xb.shape == (rows, 3) and yb.shape == (rows,)
            assert xb.sharding == world.batch and yb.sharding == world.batch
            for device, indices in zip(world.mesh.devices.flat, per_replica):
                shard = next(s for s in xb.addressable_shards if s.device == device)
                np.testing.assert_array_equal(np.asarray(shard.data), x[indices])
                shard = next(s for s in yb.addressable_shards if s.device == device)
                np.testing.assert_array_equal(np.asarray(shard.data), y[indices])


def test_calling_the_loader_iterates_it_as_in_paddle(world):
    x, y = data(32)
    loader = DataLoader(TensorDataset([x, y]), batch_size=2)
    got = [np.asarray(b).tolist() for _, (_, b) in enumerate(loader())]
    assert got == [list(range(0, 16)), list(range(16, 32))]


def test_dict_datasets_give_dict_batches(world):
    x, y = data(16)
    loader = DataLoader(TensorDataset({"image": x, "label": y}), batch_size=2)
    batch = next(iter(loader))
    assert set(batch) == {"image", "label"}
    np.testing.assert_array_equal(np.asarray(batch["label"]), np.arange(16))
    assert batch["image"].sharding == world.batch


def test_fast_path_gathers_whole_batches_without_per_sample_calls(world):
    x, y = data(40)
    fast = list(DataLoader(NoPerSampleAccess([x, y]), batch_size=2, shuffle=True))
    generic = list(DataLoader(ArrayDataset(x, y), batch_size=2, shuffle=True))
    assert_batches_equal(fast, generic)


def test_return_numpy_gives_process_local_numpy_without_fleet_init(no_world):
    x, y = data(10)
    batches = list(DataLoader(TensorDataset([x, y]), batch_size=4, return_numpy=True))
    assert all(isinstance(a, np.ndarray) for b in batches for a in b)
    assert_batches_equal(batches, [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])])


def test_collate_fn_is_used_on_the_list_of_samples(world):
    x, y = data(16)

    def collate(samples):
        return np.stack([s[0] for s in samples]) * 2

    (first, *_) = DataLoader(TensorDataset([x, y]), batch_size=1, collate_fn=collate)
    np.testing.assert_array_equal(np.asarray(first), x[:8] * 2)


def test_next_batch_is_loaded_while_the_current_one_is_in_use(world):
    x, y = data(64)
    dataset = RecordingDataset([x, y])
    it = iter(DataLoader(dataset, batch_size=2, prefetch_factor=2, use_buffer_reader=True))
    first = next(it)
    # Without asking for it, the loader already fetched (and placed) the next batch.
    assert dataset.second_batch_fetched.wait(timeout=30)
    np.testing.assert_array_equal(np.asarray(first[1]), np.arange(16))
    assert_batches_equal(list(it), [(x[16 * k:16 * k + 16], y[16 * k:16 * k + 16])
                                    for k in (1, 2, 3)])


# ------------------------------------------------------------------- workers


def test_workers_give_the_same_batches_in_order(world, no_leftover_children):
    serial = list(DataLoader(FlipDataset(70), batch_size=2, shuffle=True))
    parallel = DataLoader(FlipDataset(70), batch_size=2, shuffle=True, num_workers=2,
                          prefetch_factor=1)
    assert_batches_equal(list(parallel), serial)
    assert parallel.batch_sampler.epoch == 1


def test_persistent_workers_are_reused_across_epochs_and_closed(world, no_leftover_children):
    loader = DataLoader(WorkerIdDataset(), batch_size=1, num_workers=2,
                        persistent_workers=True, return_numpy=True)
    (ids, counts, pids), = list(loader)
    assert ids.tolist() == [0] * 8 and counts.tolist() == [2] * 8
    (_, _, pids_again), = list(loader)
    assert pids_again.tolist() == pids.tolist()
    loader.close()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in set(pids.tolist()))


def test_worker_exception_is_raised_with_the_worker_traceback(world, no_leftover_children):
    loader = DataLoader(FailingDataset(64, bad=37), batch_size=1, num_workers=2)
    with pytest.raises(ValueError, match="bad sample 37") as info:
        list(loader)
    cause = str(info.value.__cause__)
    assert "Traceback in DataLoader worker 0" in cause  # batch 4 (indices 32..39) -> worker 0
    assert 'raise ValueError(f"bad sample {i}")' in cause and "in __getitem__" in cause
    assert any("while loading batch 4 (dataset indices [32, 33" in note
               for note in info.value.__notes__)


def test_a_killed_worker_is_reported(world, no_leftover_children):
    it = iter(DataLoader(FlipDataset(400), batch_size=1, num_workers=2, prefetch_factor=1))
    next(it)
    os.kill(it._pool.pids[1], signal.SIGKILL)
    with pytest.raises(FleetWorkerError, match=r"worker 1 \(pid \d+\) exited unexpectedly "
                                               r"with exit code -9"):
        list(it)


@pytest.mark.parametrize("how", ["break", "exception", "keyboard_interrupt"])
def test_leaving_the_loop_leaves_no_worker_behind(world, no_leftover_children, how,
                                                  sigint_default):
    loader = DataLoader(FlipDataset(400), batch_size=1, num_workers=2)

    def train():
        for step, _batch in enumerate(loader):
            if step == 2:
                if how == "break":
                    break
                if how == "exception":
                    raise RuntimeError("the training step failed")
                # Ctrl-C: the terminal signals the whole process group.
                workers = [w for w in psutil.Process().children()
                           if "resource_tracker" not in " ".join(w.cmdline())]
                assert len(workers) == 2
                for w in workers:
                    os.kill(w.pid, signal.SIGINT)
                signal.raise_signal(signal.SIGINT)

    if how == "break":
        train()
    elif how == "exception":
        with pytest.raises(RuntimeError, match="the training step failed"):
            train()
    else:
        with pytest.raises(KeyboardInterrupt):
            train()


def test_worker_exceptions_leave_no_worker_behind_and_in_process_errors_too(
        world, no_leftover_children):
    with pytest.raises(ValueError, match="bad sample 3"):
        list(DataLoader(FailingDataset(64, bad=3), batch_size=1))


# ------------------------------------------------------------------- inconsistent shapes


@pytest.mark.parametrize("num_workers", [0, 1])
def test_samples_of_different_shapes_name_the_sample(world, num_workers):
    loader = DataLoader(RaggedDataset(32, odd_one=21), batch_size=2, num_workers=num_workers)
    with pytest.raises(FleetDataError, match=r"sample at dataset index 21 \(position 5 of its "
                                             r"batch\) has at \[0\] shape \(3,\), but dataset "
                                             r"index 16 has shape \(2,\)"):
        list(loader)


# ------------------------------------------------------------------- acceptance 4


@pytest.mark.parametrize("done", [0, 1, 3, 6, 7])
def test_resume_mid_epoch_continues_with_exactly_the_next_batch(world, done):
    x, y = data(110)

    def make():
        return DataLoader(TensorDataset([x, y]), batch_size=2, shuffle=True, prefetch_factor=3)

    reference = make()
    epochs = [[as_numpy(b) for b in reference] for _ in range(2)]
    assert len(epochs[0]) == 7

    interrupted = make()
    it = iter(interrupted)
    for _ in range(done):
        next(it)
    state = json.loads(json.dumps(interrupted.state_dict()))  # as a checkpoint stores it
    del it

    restarted = make()
    restarted.set_state_dict(state)
    assert_batches_equal([as_numpy(b) for b in restarted], epochs[0][done:] if done < 7
                         else epochs[1])
    if done < 7:
        assert_batches_equal([as_numpy(b) for b in restarted], epochs[1])


def test_resume_with_workers_and_a_custom_batch_sampler(world):
    x, y = data(48)

    class Plain:  # a batch sampler without state_dict(): resume skips the batches done
        def __iter__(self):
            return iter([list(range(i, i + 8)) for i in range(0, 48, 8)])

        def __len__(self):
            return 6

    loader = DataLoader(TensorDataset([x, y]), batch_sampler=Plain())
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state == {"batches_done": 2}
    restarted = DataLoader(TensorDataset([x, y]), batch_sampler=Plain())
    restarted.set_state_dict(state)
    assert [np.asarray(b[1]).tolist() for b in restarted] == [
        list(range(i, i + 8)) for i in range(16, 48, 8)]


# ------------------------------------------------------------------- acceptance 6


@pytest.mark.parametrize("shuffle", [False, True])
def test_exact_evaluation_counts_every_sample_once(world, shuffle):
    n = 37  # 8 devices x 5 = 40 after padding: 3 duplicates
    x, labels = data(n)
    predictions = (labels * 7) % 3  # a fixed "model"
    want_accuracy = np.mean(predictions == labels % 3)

    loader = DataLoader(TensorDataset([x, labels]), batch_size=2, shuffle=shuffle)
    seen, correct, padded_count = [], 0, 0
    for _, y in loader:
        pred = jax.jit(lambda t: (t * 7) % 3)(y)  # per-example outputs, still sharded
        padded_count += y.shape[0]
        kept_pred, kept_y = loader.gather_for_metrics((pred, y))
        seen += kept_y.tolist()
        correct += int(np.sum(kept_pred == kept_y % 3))
    assert padded_count == 40
    assert sorted(seen) == list(range(n))
    assert correct / len(seen) == pytest.approx(want_accuracy)


# ------------------------------------------------------------------- errors


def test_loader_argument_errors(world):
    ds = TensorDataset([np.zeros((16, 2))])
    sampler = DistributedBatchSampler(ds, 2)
    with pytest.raises(fleet.FleetConfigError,
                       match=r"batch_sampler together with batch_size=4, shuffle=False"):
        DataLoader(ds, batch_size=4, batch_sampler=sampler)
    with pytest.raises(fleet.FleetConfigError, match=r"num_workers=-1 must be at least 0"):
        DataLoader(ds, num_workers=-1)
    with pytest.raises(fleet.FleetConfigError, match=r"prefetch_factor=0 must be at least 1"):
        DataLoader(ds, prefetch_factor=0)
    with pytest.raises(fleet.FleetTypeError, match=r"num_workers must be an int, got float"):
        DataLoader(ds, num_workers=1.0)
    with pytest.raises(fleet.FleetTypeError, match=r"collate_fn must be callable or None"):
        DataLoader(ds, collate_fn="stack")
    with pytest.raises(fleet.FleetTypeError, match=r"needs a map-style dataset .* got int"):
        DataLoader(3)
    with pytest.raises(fleet.FleetConfigError,
                       match=r"covers replicas \[3, 4\) of 8, but this process feeds "
                             r"devices \[0, 8\) of 8"):
        DataLoader(ds, batch_sampler=DistributedBatchSampler(ds, 2, num_replicas=8, rank=3))


def test_loader_needs_fleet_init_unless_it_returns_numpy(no_world):
    with pytest.raises(fleet.FleetNotInitializedError, match=r"call fleet.init"):
        DataLoader(TensorDataset([np.zeros(4)]))


def test_batch_that_does_not_split_over_the_devices(world):
    ds = TensorDataset([np.zeros((13, 2))])
    loader = DataLoader(ds, batch_sampler=BatchSampler(dataset=ds, batch_size=8))
    with pytest.raises(FleetDataError, match=r"batch 1 has an array of shape \(5, 2\), whose "
                                             r"leading axis does not split over this "
                                             r"process's 8 devices"):
        list(loader)


def test_gather_for_metrics_errors(world):
    loader = DataLoader(TensorDataset([np.zeros((16, 2))]), batch_size=1)
    with pytest.raises(fleet.FleetConfigError, match=r"called before the loader yielded"):
        loader.gather_for_metrics(np.zeros(8))
    next(iter(loader))
    with pytest.raises(FleetDataError, match=r"shape \(4,\), but batch 0 has 8 rows"):
        loader.gather_for_metrics(np.zeros(4))


@pytest.mark.parametrize("arg,error,match", [
    ("nope", fleet.FleetTypeError, r"takes a list \(or dict\) of arrays, got str"),
    ([], fleet.FleetConfigError, r"got no arrays"),
    ([np.zeros(3), np.zeros(4)], fleet.FleetConfigError, r"different lengths \[3, 4\]"),
    ([np.float32(1)], fleet.FleetConfigError, r"must have a sample axis, got shapes \[\(\)\]"),
])
def test_tensor_dataset_errors(arg, error, match):
    with pytest.raises(error, match=match):
        TensorDataset(arg)


def test_loader_resume_state_error(world):
    loader = DataLoader(TensorDataset([np.zeros(16)]), batch_size=1)
    with pytest.raises(fleet.FleetConfigError, match=r"expected 'sampler'"):
        loader.set_state_dict({"batches_done": 1})


# ------------------------------------------------------------------- more paths


class StringDataset(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"name": f"sample-{i}", "value": np.float32(i)}


def set_worker_global(worker_id):
    global WORKER_INIT_ID
    WORKER_INIT_ID = worker_id + 100


def failing_worker_init(worker_id):
    raise OSError(f"cannot open the shard for worker {worker_id}")


class InitCheckDataset(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return np.int64(WORKER_INIT_ID)


WORKER_INIT_ID = -1


@pytest.mark.parametrize("use_buffer_reader", [None, True, False])
def test_with_and_without_the_buffer_thread_batches_are_the_same(world, use_buffer_reader):
    x, y = data(45)
    want = [(x[b], y[b]) for b in DistributedBatchSampler(range(45), 2, shuffle=True)]
    for dataset in (TensorDataset([x, y]), ArrayDataset(x, y)):
        loader = DataLoader(dataset, batch_size=2, shuffle=True,
                            use_buffer_reader=use_buffer_reader)
        assert_batches_equal(list(loader), want)
    with pytest.raises(ValueError, match="bad sample 20"):
        list(DataLoader(FailingDataset(64, bad=20), batch_size=1,
                        use_buffer_reader=use_buffer_reader))


def test_fast_path_loads_in_the_main_thread_when_asked(world):
    x, y = data(64)
    dataset = RecordingDataset([x, y])
    it = iter(DataLoader(dataset, batch_size=2))
    assert dataset.fetched == []  # nothing loaded before the loop asks
    next(it)
    assert len(dataset.fetched) == 1
    next(it)
    assert len(dataset.fetched) == 2


def test_string_fields_stay_on_the_host(world):
    (batch, *_) = DataLoader(StringDataset(), batch_size=1)
    assert batch["name"] == [f"sample-{i}" for i in range(8)]
    assert batch["value"].sharding == world.batch


def test_worker_init_fn_runs_in_each_worker_and_its_errors_surface(world, no_leftover_children):
    pairs = BatchSampler(dataset=InitCheckDataset(), batch_size=2)
    ids = list(DataLoader(InitCheckDataset(), batch_sampler=pairs, num_workers=2,
                          worker_init_fn=set_worker_global, return_numpy=True))
    assert [b.tolist() for b in ids] == [[100, 100], [101, 101]]  # batch k -> worker k
    loader = DataLoader(InitCheckDataset(), batch_sampler=pairs, num_workers=1,
                        worker_init_fn=failing_worker_init, return_numpy=True)
    with pytest.raises(OSError, match="cannot open the shard for worker 0") as info:
        list(loader)
    assert any("in worker_init_fn" in note for note in info.value.__notes__)


def test_workers_need_a_picklable_dataset(world, no_leftover_children):
    class Local(Dataset):  # defined in a function: spawn cannot pickle it
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return np.float32(i)

    loader = DataLoader(Local(), batch_size=1, num_workers=2)
    with pytest.raises(fleet.FleetConfigError, match=r"must pickle the dataset \(Local\), "
                                                     r"collate_fn and worker_init_fn"):
        iter(loader)


class StuckDataset(Dataset):
    def __init__(self):
        self.reading = multiprocessing.get_context("spawn").Event()

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.reading.set()
        threading.Event().wait()  # a read that never returns


def test_ctrl_c_while_waiting_for_a_stuck_worker_leaves_no_worker_behind(
        world, no_leftover_children, sigint_default):
    dataset = StuckDataset()
    it = iter(DataLoader(dataset, batch_size=1, num_workers=2))

    workers = []

    def ctrl_c():  # the terminal signals the whole foreground process group
        assert dataset.reading.wait(timeout=60)  # a worker is up and stuck in a read
        workers.extend(c for c in psutil.Process().children()
                       if "resource_tracker" not in " ".join(c.cmdline()))
        for worker in workers:
            os.kill(worker.pid, signal.SIGINT)  # workers ignore it
        os.kill(os.getpid(), signal.SIGINT)  # Linux delivers it to the main thread

    presser = threading.Thread(target=ctrl_c)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)  # blocks: no worker ever answers
    finally:
        presser.join()
    assert len(workers) == 2
    # Gone already, while the iterator is still referenced here.
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


# ------------------------------------------------------------------- shared memory transport


class GrowingDataset(Dataset):
    """Batches of 16 whose arrays grow every third batch (shared-memory blocks grow)."""

    def __len__(self):
        return 160

    def __getitem__(self, i):
        return {"x": np.full((1 + i // 48, 2), i, np.int16), "name": f"s{i}",
                "flag": np.bool_(i % 3 == 0)}


def test_shared_memory_round_trip_keeps_structure_and_values():
    from fleet.io import _shm

    batch = {"a": (np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2], ["text", 3]),
             "b": np.array([True, False]), "c": np.int64(5), "d": np.array(7)}
    size = _shm.packed_size(batch)
    assert size == 64 * 3  # three arrays, each aligned to 64 bytes
    block = bytearray(size)
    assert _shm.write(batch, memoryview(bytearray(size - 1))) is None  # too small
    skeleton = _shm.write(batch, memoryview(block))
    got = _shm.read(skeleton, memoryview(block), size)
    assert_batches_equal([got], [batch])
    assert got["a"][1] == ["text", 3] and got["c"] == 5


def test_workers_batches_whose_size_grows(world):
    serial = list(DataLoader(GrowingDataset(), batch_size=2))
    loader = DataLoader(GrowingDataset(), batch_size=2, num_workers=1, prefetch_factor=1,
                        persistent_workers=True)
    assert_batches_equal(list(loader), serial)
    assert_batches_equal(list(loader), serial)
    blocks = [b.name for b in loader._pool._blocks._all]
    assert blocks  # the later batches came through shared memory
    loader.close()
    assert not set(blocks) & set(os.listdir("/dev/shm"))  # unlinked


def test_leaving_early_unlinks_the_shared_memory(world, no_leftover_children):
    it = iter(DataLoader(FlipDataset(400), batch_size=1, num_workers=2))
    for _ in range(6):
        next(it)
    blocks = [b.name for b in it._pool._blocks._all]
    assert blocks
    del it
    assert not set(blocks) & set(os.listdir("/dev/shm"))


def test_state_saved_right_after_a_restore_keeps_the_restored_position(world):
    """Saving again before iterating (a checkpoint right after resuming) must not
    reset the position."""
    from fleet.io import BatchSampler, DataLoader, DistributedBatchSampler, TensorDataset

    ds = TensorDataset([np.arange(64)])
    for make in (lambda: DistributedBatchSampler(ds, 2),
                 lambda: BatchSampler(dataset=ds, batch_size=4)):
        loader = DataLoader(ds, batch_sampler=make(), return_numpy=True)
        it = iter(loader)
        next(it), next(it), next(it)
        saved = loader.state_dict()
        restored = DataLoader(ds, batch_sampler=make(), return_numpy=True)
        restored.set_state_dict(saved)
        assert restored.state_dict() == saved
        assert restored.batch_sampler.state_dict() == saved["sampler"]


def test_the_position_has_one_home_counted_when_a_batch_is_handed_out(world):
    """The loader loads ahead (a thread, 4 batches), but the position -- the sampler's,
    which the loader's state is -- counts only the batches the loop received, and a
    sampler iterated alone counts the same way."""
    from fleet.io import DataLoader, DistributedBatchSampler, TensorDataset

    ds = TensorDataset([np.arange(200, dtype=np.float32)])
    sampler = DistributedBatchSampler(ds, 1, shuffle=True)
    loader = DataLoader(ds, batch_sampler=sampler, prefetch_factor=4, use_buffer_reader=True)
    steps = len(loader)
    for epoch in range(2):
        for i, (x,) in enumerate(loader):
            if i == 1:
                threading.Event().wait(0.2)  # let the thread fill its queue
            want = {"epoch": epoch, "batches_done": i + 1} if i + 1 < steps else {
                "epoch": epoch + 1, "batches_done": 0}
            assert {k: sampler.state_dict()[k] for k in want} == want
            assert loader.state_dict() == {"sampler": sampler.state_dict()}
            rows = loader.gather_for_metrics(x)
            assert len(rows) == world.num_replicas or i + 1 == steps
        assert sampler.state_dict()["epoch"] == epoch + 1
    alone = DistributedBatchSampler(ds, 1, shuffle=True)
    alone.set_epoch(1)
    it = iter(alone)
    next(it), next(it)
    assert (alone.state_dict()["epoch"], alone.state_dict()["batches_done"]) == (1, 2)


def test_gather_for_metrics_for_an_earlier_step_of_the_iteration(world):
    """Outputs fetched a step late (as fleet.Model does) drop that step's padding."""
    from fleet.io import DataLoader, TensorDataset

    n = world.num_replicas * 2 + 3  # the last global batch is padded
    loader = DataLoader(TensorDataset([np.arange(n)]), batch_size=1)
    seen, previous = [], None
    for step, (x,) in enumerate(loader):
        if previous is not None:
            seen += loader.gather_for_metrics(previous, step=step - 1).tolist()
        previous = x
        with pytest.raises(fleet.FleetConfigError, match=rf"step={step + 1}\): this iteration "
                                                         rf"has yielded batches 0\.\.{step}"):
            loader.gather_for_metrics(x, step=step + 1)
    seen += loader.gather_for_metrics(previous, step=len(loader) - 1).tolist()
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loop_left_early_keeps_its_position_and_resume_continues_there(
        world, num_workers, no_leftover_children):
    """The position lives in the loader's iterator; once the loop is left (the iterator
    dropped), the state still says where it stopped, and gather_for_metrics still
    knows the batches it yielded. A new loop starts the next epoch; a restore continues."""
    ds = FlipDataset(70)

    def make():
        return DataLoader(ds, batch_size=1, shuffle=True, num_workers=num_workers,
                          return_numpy=True)

    epoch0 = [as_numpy(b) for b in make()]
    loader = make()
    for step, batch in enumerate(loader):  # noqa: B007 (the last batch is used below)
        if step == 3:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    assert {k: state["sampler"][k] for k in ("epoch", "batches_done")} == {
        "epoch": 0, "batches_done": 4}
    assert len(loader.gather_for_metrics(batch["label"], step=3)) == len(batch["label"])
    restarted = make()
    restarted.set_state_dict(state)
    assert_batches_equal([as_numpy(b) for b in restarted], epoch0[4:])
    next(iter(loader))
    assert loader.state_dict()["sampler"]["epoch"] == 1
    loader.close()
