"""fleet.io samplers against an independent re-implementation of Paddle's algorithm."""

import itertools
import json
import math

import jax
import numpy as np
import pytest

import fleet
from fleet.io import BatchSampler, DistributedBatchSampler
from fleet.runtime import _world

# ----------------------------------------------------------------------------- reference
# A line-by-line re-implementation of paddle.io.DistributedBatchSampler.__iter__ on
# Python lists, with the cyclic padding; deliberately not sharing any code
# with fleet.io.


def reference_order(n, num_replicas, shuffle, epoch):
    total = math.ceil(n / num_replicas) * num_replicas
    indices = list(range(n))
    i = 0
    while len(indices) < total:  # Repeat from the start, cyclically.
        indices.append(indices[i])
        i += 1
    if shuffle:
        np.random.RandomState(epoch).shuffle(indices)
    return indices


def reference_batches(n, batch_size, num_replicas, rank, shuffle, drop_last, epoch):
    indices = reference_order(n, num_replicas, shuffle, epoch)
    total = len(indices)
    last_batch_size = total % (batch_size * num_replicas)
    assert last_batch_size % num_replicas == 0
    last_local_batch_size = last_batch_size // num_replicas
    mine = []
    for i in range(rank * batch_size, total - last_batch_size, batch_size * num_replicas):
        mine.extend(indices[i : i + batch_size])
    tail = indices[total - last_batch_size :]
    mine.extend(tail[rank * last_local_batch_size : (rank + 1) * last_local_batch_size])
    assert len(mine) == math.ceil(n / num_replicas)
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


CASES = list(
    itertools.product(
        [1, 3, 8, 13, 64, 101],  # dataset sizes: below, equal to, above the replica counts
        [1, 2, 3, 8],  # replicas
        [1, 4, 5],  # per-replica batch size
        [False, True],  # shuffle
        [False, True],  # drop_last
    )
)


@pytest.fixture
def no_world():
    _world._WORLD = None
    yield
    _world._WORLD = None


def sampler(n, bs, replicas, rank, shuffle=False, drop_last=False, **kw):
    return DistributedBatchSampler(range(n), bs, num_replicas=replicas, rank=rank,
                                   shuffle=shuffle, drop_last=drop_last, **kw)


def no_batch(n, bs, replicas, drop_last):
    """Where the reference gives no batch at all (drop_last, batch_size > a replica's
    share), the samplers refuse to be built (issue 10), on every rank; and so does the
    single-device BatchSampler over the padded order."""
    if reference_batches(n, bs, replicas, 0, False, drop_last, 0):
        return False
    assert drop_last
    for rank in range(replicas):
        with pytest.raises(fleet.FleetConfigError, match=rf"batch_size={bs}, drop_last=True\) over "
                                                   rf"{n} samples.* gives no batch"):
            sampler(n, bs, replicas, rank, drop_last=drop_last)
    with pytest.raises(fleet.FleetConfigError, match="gives no batch"):
        BatchSampler(sampler=reference_order(n, replicas, False, 0), batch_size=bs * replicas,
                     drop_last=True)
    return True


# ------------------------------------------------------------------- acceptance 1


@pytest.mark.parametrize("n,replicas,bs,shuffle,drop_last", CASES)
def test_index_lists_equal_reference(no_world, n, replicas, bs, shuffle, drop_last):
    if no_batch(n, bs, replicas, drop_last):
        return
    for rank in range(replicas):
        s = sampler(n, bs, replicas, rank, shuffle, drop_last)
        for epoch in range(3):  # epoch advances by itself each time iteration starts
            want = reference_batches(n, bs, replicas, rank, shuffle, drop_last, epoch)
            assert list(s) == want, (rank, epoch)
            assert len(s) == len(want)


@pytest.mark.parametrize("first,count", [(0, 8), (0, 3), (2, 3), (5, 3), (7, 1)])
@pytest.mark.parametrize("shuffle,drop_last", [(False, False), (True, True), (True, False)])
def test_several_local_replicas_concatenate_their_batches(no_world, first, count, shuffle,
                                                          drop_last):
    n, bs, replicas = 101, 4, 8
    s = sampler(n, bs, replicas, first, shuffle, drop_last, num_local_replicas=count)
    for epoch in range(2):
        per_replica = [reference_batches(n, bs, replicas, r, shuffle, drop_last, epoch)
                       for r in range(first, first + count)]
        want = [sum(step, []) for step in zip(*per_replica)]
        assert list(s) == want


# ------------------------------------------------------------------- acceptance 2


@pytest.mark.parametrize("n,replicas,bs,shuffle,drop_last", CASES)
def test_union_of_replicas_is_the_single_device_global_batch(no_world, n, replicas, bs,
                                                             shuffle, drop_last):
    if no_batch(n, bs, replicas, drop_last):
        return
    samplers = [sampler(n, bs, replicas, r, shuffle, drop_last) for r in range(replicas)]
    for epoch in range(2):
        order = reference_order(n, replicas, shuffle, epoch)
        single = list(BatchSampler(sampler=order, batch_size=bs * replicas,
                                   drop_last=drop_last))
        per_replica = [list(s) for s in samplers]
        assert len({len(b) for b in per_replica}) == 1  # same number of steps everywhere
        union = [sum(step, []) for step in zip(*per_replica)]
        assert union == single


# ------------------------------------------------------------------- acceptance 3


def test_orders_differ_across_epochs_agree_across_replicas_and_set_epoch_reproduces(no_world):
    n, bs, replicas = 64, 4, 4
    samplers = [sampler(n, bs, replicas, r, shuffle=True) for r in range(replicas)]
    epochs = [[list(s) for s in samplers] for _ in range(3)]
    flat = [sum((sum(r, []) for r in epoch), []) for epoch in epochs]
    # Agree: the replicas' disjoint shares together are one permutation of the data.
    for indices in flat:
        assert sorted(indices) == list(range(n))
    assert flat[0] != flat[1] != flat[2] != flat[0]
    for s in samplers:
        assert s.epoch == 3
    samplers[2].set_epoch(1)
    assert list(samplers[2]) == epochs[1][2]
    assert samplers[2].epoch == 2


def test_unshuffled_order_is_the_same_every_epoch(no_world):
    s = sampler(10, 3, 2, 0)
    assert list(s) == list(s) == [[0, 1, 2], [6, 7]]


# ------------------------------------------------------------------- acceptance 4 (sampler)


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(no_world, shuffle):
    n, bs, replicas, rank = 37, 2, 3, 1
    full = [reference_batches(n, bs, replicas, rank, shuffle, False, e) for e in range(3)]
    for epoch, done in [(0, 0), (0, 1), (1, 4), (1, len(full[1]) - 1), (2, 3)]:
        s = sampler(n, bs, replicas, rank, shuffle)
        s.set_epoch(epoch)
        it = iter(s)
        taken = [next(it) for _ in range(done)]
        assert taken == full[epoch][:done]
        state = json.loads(json.dumps(s.state_dict()))  # plain data, survives a checkpoint
        assert state["epoch"] == epoch and state["batches_done"] == done

        restarted = sampler(n, bs, replicas, rank, shuffle)
        restarted.set_state_dict(state)
        restarted.set_epoch(epoch)  # the usual per-epoch call keeps the resume point
        assert list(restarted) == full[epoch][done:]
        if epoch + 1 < len(full):
            assert list(restarted) == full[epoch + 1]


def test_state_between_epochs_is_the_next_epoch(no_world):
    s = sampler(10, 2, 2, 0, shuffle=True)
    list(s)
    assert s.state_dict()["epoch"] == 1 and s.state_dict()["batches_done"] == 0


def test_set_epoch_to_another_epoch_drops_the_pending_resume(no_world):
    s = sampler(10, 1, 1, 0, shuffle=True)
    s.set_state_dict({"epoch": 0, "batches_done": 4})
    s.set_epoch(2)
    assert list(s) == reference_batches(10, 1, 1, 0, True, False, 2)


def test_batch_sampler_shuffle_and_resume():
    s = BatchSampler(dataset=range(10), shuffle=True, batch_size=3)
    e0, e1 = list(s), list(s)
    assert sorted(sum(e0, [])) == list(range(10)) and e0 != e1
    assert e0 == [p.tolist() for p in np.split(np.random.RandomState(0).permutation(10),
                                                 [3, 6, 9])]
    t = BatchSampler(dataset=range(10), shuffle=True, batch_size=3)
    it = iter(t)
    next(it), next(it)
    u = BatchSampler(dataset=range(10), shuffle=True, batch_size=3)
    u.set_state_dict(t.state_dict())
    assert list(u) == e0[2:]
    assert len(u) == 4 and len(BatchSampler(dataset=range(10), batch_size=3,
                                            drop_last=True)) == 3


# ------------------------------------------------------------------- acceptance 6 (mask)


@pytest.mark.parametrize("n,replicas,bs,shuffle", [(13, 8, 1, False), (13, 8, 3, True),
                                                   (3, 8, 2, True), (101, 3, 4, True),
                                                   (64, 8, 4, False)])
def test_padding_mask_leaves_every_sample_exactly_once(no_world, n, replicas, bs, shuffle):
    s = sampler(n, bs, replicas, 0, shuffle)
    for epoch in range(2):
        global_batches = [sum(step, []) for step in zip(*[
            reference_batches(n, bs, replicas, r, shuffle, False, epoch)
            for r in range(replicas)])]
        kept = []
        for step, batch in enumerate(global_batches):
            mask = s.padding_mask(step, epoch)
            assert mask.shape == (len(batch),)
            kept += [i for i, pad in zip(batch, mask) if not pad]
        assert sorted(kept) == list(range(n))
        total = math.ceil(n / replicas) * replicas
        assert sum(len(b) for b in global_batches) - len(kept) == total - n


# ------------------------------------------------------------------- defaults from fleet


def test_defaults_split_over_every_device_of_the_world(world):
    s = DistributedBatchSampler(range(100), 4)
    assert (s.num_replicas, s.rank, s.num_local_replicas) == (8, 0, 8)
    assert s.num_samples == 13 and s.total_size == 104
    got = list(s)
    want = [sum(step, []) for step in zip(*[reference_batches(100, 4, 8, r, False, False, 0)
                                            for r in range(8)])]
    assert got == want and len(got[0]) == 32


def test_defaults_with_a_four_device_world():
    _world._WORLD = None
    try:
        fleet.init(devices=jax.devices()[:4])
        s = DistributedBatchSampler(range(10), 2)
        assert (s.num_replicas, s.rank, s.num_local_replicas) == (4, 0, 4)
        explicit = DistributedBatchSampler(range(10), 2, num_replicas=4, rank=2)
        assert (explicit.num_replicas, explicit.rank, explicit.num_local_replicas) == (4, 2, 1)
    finally:
        _world._WORLD = None


def test_defaults_without_fleet_init_are_one_replica(no_world):
    s = DistributedBatchSampler(range(5), 2)
    assert (s.num_replicas, s.rank, s.num_local_replicas) == (1, 0, 1)
    assert list(s) == [[0, 1], [2, 3], [4]]


# ------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(batch_size=0), fleet.FleetConfigError, r"batch_size=0 must be at least 1"),
    (dict(batch_size=2.5), fleet.FleetTypeError, r"batch_size must be an int, got float"),
    (dict(num_replicas=0), fleet.FleetConfigError, r"num_replicas=0 must be at least 1"),
    (dict(num_replicas=4, rank=4), fleet.FleetConfigError,
     r"rank=4 .* covers replicas \[4, 5\), outside the 4 replicas \(allowed ranks: 0..3\)"),
    (dict(num_replicas=4, rank=-1), fleet.FleetConfigError, r"rank=-1"),
    (dict(num_replicas=4, rank=2, num_local_replicas=3), fleet.FleetConfigError,
     r"covers replicas \[2, 5\), outside the 4 replicas \(allowed ranks: 0..1\)"),
    (dict(num_replicas=2, rank="0"), fleet.FleetTypeError, r"rank must be an int, got str"),
    (dict(dataset=[]), fleet.FleetConfigError, r"empty dataset"),
    (dict(dataset=iter([1, 2])), fleet.FleetTypeError, r"list_iterator has no len\(\)"),
])
def test_distributed_sampler_errors(no_world, kwargs, error, match):
    args = dict(dataset=range(10), batch_size=2) | kwargs
    with pytest.raises(error, match=match):
        DistributedBatchSampler(**args)


def test_batch_sampler_errors():
    with pytest.raises(fleet.FleetConfigError, match="exactly one of dataset= or sampler=, got both"):
        BatchSampler(dataset=range(3), sampler=range(3))
    with pytest.raises(fleet.FleetConfigError, match="got neither"):
        BatchSampler()
    with pytest.raises(fleet.FleetConfigError, match=r"sampler fixes the order"):
        BatchSampler(sampler=range(3), shuffle=True)


def test_state_and_epoch_errors(no_world):
    s = sampler(10, 2, 2, 0)
    saved = sampler(10, 2, 4, 0).state_dict()
    with pytest.raises(fleet.FleetConfigError,
                       match=r"saved with num_replicas=4 but this sampler has num_replicas=2"):
        s.set_state_dict(saved)
    with pytest.raises(fleet.FleetConfigError, match=r"batches_done=9 is outside 0..3"):
        s.set_state_dict({"epoch": 0, "batches_done": 9})
    with pytest.raises(fleet.FleetConfigError, match=r"missing \['batches_done'\]"):
        s.set_state_dict({"epoch": 0})
    with pytest.raises(fleet.FleetConfigError, match=r"epoch must be an int >= 0, got -1"):
        s.set_epoch(-1)
    with pytest.raises(fleet.FleetConfigError, match=r"step=3 is outside 0..2"):
        s.padding_mask(3)


def test_the_sampler_holds_no_shared_position(no_world):
    """state_dict() is computed: a shallow copy restored elsewhere (what a checkpoint's
    probe does) leaves the original alone, and a pickled sampler keeps its state."""
    import copy
    import pickle

    s = sampler(20, 2, 2, 0, shuffle=True)
    it = iter(s)
    next(it), next(it)
    before = s.state_dict()
    copy.copy(s).set_state_dict({"epoch": 5, "batches_done": 1})
    assert s.state_dict() == before and before["batches_done"] == 2
    assert pickle.loads(pickle.dumps(s)).state_dict() == before
    restored = sampler(20, 2, 2, 0, shuffle=True)
    restored.set_state_dict(before)
    dropped = iter(restored)  # started, then dropped before a batch was handed out
    del dropped
    assert restored.state_dict() == before
