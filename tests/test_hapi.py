"""fleet.Model (fleet/hapi): training equals the single-device script on the same
global batches, evaluation and prediction are exact, callbacks, saving, errors.

The reference is written by hand, as a single-device user would: ``nnx.jit``,
global batches cut from Paddle's shuffle (``RandomState(epoch).shuffle``).
"""

import io

import jax
import numpy as np
import optax
import pytest
from flax import linen, nnx

import fleet
from fleet.hapi import Model, callbacks, metric
from fleet.io import DataLoader, DistributedBatchSampler, TensorDataset
from fleet.runtime import _world
from tests import tiers

TOL = 1e-5
N_TRAIN, N_EVAL, FEATURES, CLASSES = 100, 37, 12, 4
GLOBAL_BATCH, LR = 16, 1e-2


class Net(nnx.Module):
    """A small MLP (no dropout: training is deterministic)."""

    def __init__(self, rngs: nnx.Rngs, hidden: int = 32):
        self.linear1 = nnx.Linear(FEATURES, hidden, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    x = rng.randn(n, FEATURES).astype(np.float32)
    y = (x[:, :CLASSES] + 0.5 * rng.randn(n, CLASSES)).argmax(1).astype(np.int32)
    return x, y


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def flat_params(module) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    out = {}
    for path, var in flat:
        value = var.get_value()
        if hasattr(value, "addressable_shards"):
            value = value.addressable_shards[0].data
        out[".".join(map(str, path))] = np.asarray(value)
    return out


def reference_params(x, y, global_batch, epochs, lr=LR, tx=optax.adam, shuffle=True):
    """The single-device script: nnx.jit, Paddle's shuffled order, global batches."""
    with jax.default_device(jax.devices()[0]):
        model = Net(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx(lr), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, xb, yb):
            loss, grads = nnx.value_and_grad(lambda m: ce(m(xb), yb).mean())(model)
            optimizer.update(model, grads)
            return loss

        for epoch in range(epochs):
            order = np.arange(len(x))
            if shuffle:
                np.random.RandomState(epoch).shuffle(order)
            for start in range(0, len(x), global_batch):
                idx = order[start:start + global_batch]
                step(model, optimizer, x[idx], y[idx])
        return flat_params(model)


def single_device_logits(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The fleet-trained parameters, applied on one device without fleet."""
    with jax.default_device(jax.devices()[0]):
        net = Net(nnx.Rngs(1))
        for path, var in nnx.to_flat_state(nnx.state(net, nnx.Param)):
            var.set_value(jax.numpy.asarray(params[".".join(map(str, path))]))
        return np.asarray(jax.jit(lambda x: net(x))(x))


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def prepared(net=None, tx=None, metrics=None, loss=ce) -> Model:
    model = Model(net or Net(nnx.Rngs(0)))
    model.prepare(tx or optax.adam(LR), loss,
                  metric.Accuracy() if metrics is None else metrics)
    return model


@pytest.fixture(scope="module")
def train_set():
    return make_data(N_TRAIN, seed=0)


@pytest.fixture(scope="module")
def eval_set():
    return make_data(N_EVAL, seed=1)


@pytest.fixture(scope="module")
def reference(train_set):
    return reference_params(*train_set, GLOBAL_BATCH, epochs=2)


# -- acceptance 4: the single device's parameters and exact metrics ------------------------

@pytest.mark.parametrize("n", tiers.devices(1, 4))
def test_fit_trains_the_single_device_model_and_evaluates_exactly(
        make_world, train_set, eval_set, reference, n):
    make_world(n)
    model = prepared(metrics=[metric.Accuracy(), metric.Accuracy(topk=(1, 2), name="k")])
    history = model.fit(TensorDataset(list(train_set)), TensorDataset(list(eval_set)),
                        batch_size=GLOBAL_BATCH // n, epochs=2, verbose=0)
    assert max_diff(flat_params(model.network), reference) < TOL

    # evaluate: 37 samples, 3 per device -> the last global batch is padded on 4 devices.
    result = model.evaluate(TensorDataset(list(eval_set)), batch_size=3, verbose=0)
    logits = single_device_logits(flat_params(model.network), eval_set[0])
    correct = logits.argmax(1) == eval_set[1]
    top2 = (np.argsort(-logits, 1)[:, :2] == eval_set[1][:, None]).any(1)
    assert result["acc"] == correct.sum() / N_EVAL  # exact: no padding counted
    assert result["k_top1"] == result["acc"] and result["k_top2"] == top2.sum() / N_EVAL
    # Paddle's shape, {'loss': [value], ...}: here the mean over every sample (issue 23)
    assert result["loss"] == [pytest.approx(float(ce(logits, eval_set[1]).mean()), abs=1e-6)]
    assert [h["epoch"] for h in history] == [0, 1]
    assert history[-1]["eval_acc"] == result["acc"]
    assert history[-1]["eval_loss"] == pytest.approx(result["loss"][0], abs=1e-6)

    # predict: one row per sample, in dataset order (labels in the samples are ignored).
    outputs = model.predict(TensorDataset(list(eval_set)), batch_size=3, verbose=0)
    assert len(outputs) == 1 and sum(len(b) for b in outputs[0]) == N_EVAL
    np.testing.assert_allclose(np.concatenate(outputs[0]), logits, atol=TOL, rtol=0)
    stacked = model.predict(TensorDataset([eval_set[0]]), batch_size=5, verbose=0,
                            stack_outputs=True)
    np.testing.assert_allclose(stacked[0], logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("tx", [optax.sgd, optax.adam])
def test_accumulated_batches_update_as_one_step_on_their_union(make_world, train_set, tx):
    """SGD sees the gradient's scale (Adam hardly does): the update is the mean over
    the accumulated batches, not their sum, whatever no_sync does underneath."""
    make_world(4)
    x, y = train_set[0][:96], train_set[1][:96]
    model = prepared(tx=tx(LR))
    model.fit(TensorDataset([x, y]), batch_size=2, accumulate_grad_batches=2, epochs=1,
              verbose=0)  # global batches of 8, two per update = the reference's 16
    assert max_diff(flat_params(model.network), reference_params(x, y, 16, 1, tx=tx)) < TOL
    # 80 rows: 10 global batches of 8 in groups of 3 -> the last update has one batch.
    x, y = x[:80], y[:80]
    model = prepared(tx=tx(LR))
    model.fit(TensorDataset([x, y]), batch_size=2, accumulate_grad_batches=3, epochs=1,
              shuffle=False, verbose=0)
    want = reference_params(x, y, 24, 1, tx=tx, shuffle=False)  # rows 0-23, ..., 72-79
    assert max_diff(flat_params(model.network), want) < TOL


def test_a_dataloader_is_used_as_given_and_num_iters_stops(make_world, train_set):
    make_world(2)
    ds = TensorDataset(list(train_set))
    loader = DataLoader(ds, batch_sampler=DistributedBatchSampler(ds, 5, drop_last=True))
    seen = []

    class Steps(callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            seen.append((step, logs["batch_size"]))

    model = prepared()
    model.fit(loader, epochs=1, verbose=0, callbacks=[Steps()])
    assert seen == [(i, 10) for i in range(10)]  # 100 samples, 5 per device, 2 devices
    seen.clear()
    history = model.fit(loader, epochs=5, num_iters=13, verbose=0, callbacks=[Steps()])
    assert len(seen) == 13 and len(history) == 2


def test_one_batch_api_matches_the_loops(make_world, train_set):
    make_world(4)
    x, y = train_set[0][:16], train_set[1][:16]
    model = prepared()
    loss, (acc,) = model.train_batch([x], [y])
    reference = reference_params(x, y, 16, 1)
    assert max_diff(flat_params(model.network), reference) < TOL
    logits = single_device_logits(flat_params(model.network), x)
    (eval_loss,), (eval_acc,) = model.eval_batch([x], [y])
    assert eval_acc == (logits.argmax(1) == y).mean()
    assert eval_loss == pytest.approx(float(ce(logits, y).mean()), abs=1e-6)
    np.testing.assert_allclose(model.predict_batch([x])[0], logits, atol=TOL, rtol=0)
    assert 0 <= acc <= 1 and loss[0] > 0


def test_model_initialises_fleet_on_every_local_device(train_set):
    _world._WORLD = None
    try:
        model = prepared()
        assert fleet.num_replicas() == jax.local_device_count() == 8
        model.fit(TensorDataset(list(train_set)), batch_size=2, verbose=0)
    finally:
        _world._WORLD = None


# -- dropout: each replica draws its rows of the single-device mask -------------------------

class DropNet(Net):
    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def test_fit_with_dropout_equals_one_device_and_rng_state_stays_replicated(make_world, train_set):
    """Spec since issue 33: masks are the single-device masks (global batch 16; fit's
    batch_size is per replica, as in Paddle. Before, each replica
    folded its index into the key: independent masks, a per-replica reference)."""
    x, y = train_set
    trained = {}
    for n in (1, 4):
        make_world(n)
        model = prepared(DropNet(nnx.Rngs(0, dropout=1)))
        model.fit(TensorDataset([x, y]), batch_size=16 // n, epochs=1, shuffle=False, verbose=0)
        trained[n] = (flat_params(model.network), model.network.dropout.rngs)
    diff = max(float(np.max(np.abs(trained[1][0][k] - trained[4][0][k]))) for k in trained[1][0])
    print(f"1 against 4 replicas: parameters max diff {diff:.2e}")
    assert diff < 1e-5
    rngs = trained[4][1]
    key = rngs.key.get_value()
    assert key.sharding.is_fully_replicated and fleet.check_replicas(key) == []
    assert int(rngs.count.get_value()) == int(trained[1][1].count.get_value()) == -(-len(x) // 16)


# -- metrics ------------------------------------------------------------------------------

def test_accuracy_matches_numpy_top_k():
    rng = np.random.RandomState(0)
    pred = rng.randn(50, 6).astype(np.float32)
    label = rng.randint(0, 6, 50)
    acc = metric.Accuracy(topk=(1, 3))
    order = np.argsort(-pred, 1)
    want = [float((order[:, :k] == label[:, None]).any(1).mean()) for k in (1, 3)]
    assert acc.update(np.asarray(acc.compute(pred, label))) == want
    assert acc.update(np.asarray(acc.compute(pred, label[:, None]))) == want  # (N, 1)
    assert acc.update(np.asarray(acc.compute(pred, np.eye(6)[label]))) == want  # one-hot
    assert acc.accumulate() == want and acc.name() == ["acc_top1", "acc_top3"]
    acc.reset()
    assert acc.accumulate() == [0.0, 0.0]
    assert metric.Accuracy(name="top").name() == ["top"]


@pytest.mark.parametrize("kwargs,match", [
    ({"topk": 0}, r"topk=0\): topk must be a positive int"),
    ({"topk": ()}, r"non-empty tuple"),
    ({"topk": "1"}, r"topk='1'"),
    ({"name": 3}, r"name must be a string"),
])
def test_accuracy_rejects_bad_arguments(kwargs, match):
    with pytest.raises(fleet.FleetConfigError if "topk" in kwargs else fleet.FleetTypeError,
                       match=match):
        metric.Accuracy(**kwargs)


def test_accuracy_rejects_too_few_classes_and_bad_prediction_shapes():
    with pytest.raises(fleet.FleetConfigError, match=r"needs at least 5 classes, but the "
                                                     r"predictions have 3"):
        metric.Accuracy(topk=5).compute(np.zeros((2, 3)), np.zeros(2))
    with pytest.raises(fleet.FleetConfigError, match=r"got \(2, 3, 1\)"):
        metric.Accuracy().compute(np.zeros((2, 3, 1)), np.zeros(2))


def paddle_accuracy(input, label, k):
    """Paddle's accuracy op, transcribed (paddle.topk, then the CPU kernel's loop):
    a row counts once when any of its k top indices equals its label."""
    indices = np.argsort(-np.asarray(input), axis=1, kind="stable")[:, :k]
    label = np.asarray(label).reshape(-1)
    num_correct = 0
    for i in range(len(indices)):
        for j in range(k):
            if indices[i, j] == label[i]:
                num_correct += 1
                break
    return np.float32(num_correct / len(indices))


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("label_shape", ["(N, 1)", "(N,)"])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_accuracy_function_is_paddles(k, label_shape, dtype):
    rng = np.random.RandomState(k)
    logits = rng.randn(64, 10).astype(np.float32)
    label = rng.randint(0, 10, 64).astype(dtype)
    label = label[:, None] if label_shape == "(N, 1)" else label
    got = metric.accuracy(logits, label, k=k)
    assert got.shape == () and got.dtype == np.float32
    assert float(got) == paddle_accuracy(logits, label, k)
    assert float(metric.accuracy(jax.nn.softmax(logits), label, k)) == float(got)  # probs
    acc = metric.Accuracy(topk=k)  # the class form agrees
    assert float(got) == pytest.approx(acc.update(np.asarray(acc.compute(logits, label))))


def test_accuracy_function_in_a_distributed_step_is_the_global_batch_value(make_world):
    """Seed 003's loop: acc = paddle.metric.accuracy(predicts, y_data) inside the step.
    On 8 replicas the step returns the mean of the replicas' values: the global
    batch's accuracy (equal rows per replica)."""
    world = make_world(8)
    rng = np.random.RandomState(0)
    logits = rng.randn(64, 10).astype(np.float32)
    label = rng.randint(0, 10, (64, 1))
    logits[::3, 3] = 10.0  # some rows right, some wrong, unevenly spread over replicas
    label[::3] = 3
    step = fleet.distributed_step(lambda p, y: metric.accuracy(p, y), batch_argnums=(0, 1))
    assert world.num_replicas == 8
    assert float(step(logits, label)) == pytest.approx(paddle_accuracy(logits, label, 1),
                                                       abs=1e-6)


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((np.zeros((4, 3)), np.zeros(4, int)), {"k": 4}, fleet.FleetConfigError,
     r"accuracy\(k=4\) needs at least 4 classes, but input has 3"),
    ((np.zeros((4, 3)), np.zeros(4, int)), {"k": 0}, fleet.FleetConfigError,
     r"k=0\): k must be a positive int"),
    ((np.zeros((4, 3, 1)), np.zeros(4, int)), {}, fleet.FleetConfigError,
     r"input of shape \(batch, num_classes\), got \(4, 3, 1\)"),
    ((np.zeros((4, 3)), np.zeros(5, int)), {}, fleet.FleetConfigError,
     r"label of shape \(4,\) or \(4, 1\) .*got \(5,\)"),
    ((np.zeros((4, 3)), np.zeros((4, 3))), {}, fleet.FleetConfigError,
     r"got \(4, 3\)"),
    ((np.zeros((4, 3)), np.zeros(4)), {}, fleet.FleetTypeError,
     r"integer class indices as label, got dtype float"),
    ((np.zeros((4, 3)), np.zeros(4, int)), {"correct": np.zeros(1)}, fleet.FleetError,
     r"correct=..., total=...\): Paddle fills those tensors in place"),
])
def test_accuracy_function_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        metric.accuracy(*args, **kwargs)


# -- callbacks ----------------------------------------------------------------------------

def test_callback_hooks_run_in_order(make_world, train_set, eval_set):
    make_world(2)
    calls = []

    class Record(callbacks.Callback):
        def __getattribute__(self, name):
            if name.startswith("on_") and name not in ("on_begin", "on_end", "on_batch_begin",
                                                       "on_batch_end"):
                return lambda *a: calls.append(name)
            return super().__getattribute__(name)

    model = prepared()
    model.fit(TensorDataset(list(train_set)), TensorDataset(list(eval_set)), batch_size=25,
              epochs=2, eval_freq=2, verbose=0, callbacks=[Record()])
    epoch = ["on_epoch_begin", *["on_train_batch_begin", "on_train_batch_end"] * 2,
             "on_epoch_end"]
    evaluation = ["on_eval_begin", *["on_eval_batch_begin", "on_eval_batch_end"] * 1,
                  "on_eval_end"]
    # Paddle evaluates when epoch % eval_freq == 0: after epoch 0 of 0, 1.
    assert calls == ["on_train_begin", *epoch, *evaluation, *epoch, "on_train_end"]


@pytest.mark.parametrize("epochs,eval_freq,evaluated", [
    (5, 2, [0, 2, 4]), (4, 2, [0, 2]), (3, 1, [0, 1, 2]), (4, 3, [0, 3]), (2, 5, [0]),
])
def test_fit_evaluates_at_paddles_epochs(make_world, train_set, eval_set, epochs, eval_freq,
                                         evaluated):
    """paddle.Model.fit: `if do_eval and epoch % eval_freq == 0` (0-based epochs)."""
    make_world(2)
    x, y = train_set[0][:16], train_set[1][:16]
    model = prepared()
    history = model.fit(TensorDataset([x, y]), TensorDataset(list(eval_set)), batch_size=8,
                        epochs=epochs, eval_freq=eval_freq, verbose=0)
    assert [h["epoch"] for h in history] == list(range(epochs))
    assert [h["epoch"] for h in history if "eval_acc" in h] == evaluated


def test_early_stopping_stops_when_the_monitored_value_stalls(make_world, train_set, eval_set,
                                                              tmp_path):
    make_world(2)
    model = prepared(tx=optax.sgd(0.0))  # nothing changes: the eval loss never improves
    stop = callbacks.EarlyStopping(monitor="loss", patience=1, verbose=0)
    history = model.fit(TensorDataset(list(train_set)), TensorDataset(list(eval_set)),
                        batch_size=25, epochs=10, verbose=0, callbacks=[stop],
                        save_dir=tmp_path)
    assert len(history) == 3 and model.stop_training and stop.stopped_epoch == 2
    assert (tmp_path / "best_model.pdparams").exists()
    with pytest.raises(fleet.FleetConfigError, match=r"monitor='f1'\) is not among the "
                                                     r"evaluation values \['loss', 'acc'\]"):
        model.fit(TensorDataset(list(train_set)), verbose=0,
                  callbacks=[callbacks.EarlyStopping(monitor="f1")])


def test_model_checkpoint_saves_every_save_freq_epochs(make_world, train_set, tmp_path):
    make_world(2)
    model = prepared()
    model.fit(TensorDataset(list(train_set)), batch_size=25, epochs=3, save_freq=2,
              save_dir=tmp_path / "ckpt", verbose=0)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".fleet-lock", "2", "final.pdopt", "final.pdparams"]  # epoch 2 of 3 (save_freq=2), the end


def test_fit_resume_continues_from_the_last_epoch_checkpoint(make_world, train_set, tmp_path):
    """2 epochs straight vs 1 epoch, a new Model (a restarted job), fit(resume=True):
    the same parameters, optimizer state and shuffled order, bitwise."""
    make_world(2)
    ds = TensorDataset(list(train_set))
    straight = prepared()
    straight.fit(ds, batch_size=8, epochs=2, verbose=0)

    first = prepared()
    first.fit(ds, batch_size=8, epochs=1, save_dir=tmp_path / "ckpt", verbose=0)
    again = prepared(net=Net(nnx.Rngs(5)))  # other initial values: all come from the checkpoint
    history = again.fit(ds, batch_size=8, epochs=2, save_dir=tmp_path / "ckpt", resume=True,
                        verbose=0)
    assert [h["epoch"] for h in history] == [1]  # only the epoch that was left
    assert max_diff(flat_params(again.network), flat_params(straight.network)) == 0
    with pytest.raises(fleet.FleetConfigError, match="no save_dir was given"):
        again.fit(ds, batch_size=8, epochs=2, resume=True, verbose=0)


def test_lr_scheduler_sets_the_learning_rate_per_epoch_and_per_step(make_world, train_set):
    make_world(2)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    model = prepared(tx=tx)
    start = flat_params(model.network)
    snapshots = []

    class Snapshot(callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            snapshots.append(flat_params(self.model.network))

    by_epoch = callbacks.LRScheduler(lambda epoch: [0.0, 0.1][epoch])
    model.fit(TensorDataset(list(train_set)), batch_size=25, epochs=2, verbose=0,
              callbacks=[by_epoch, Snapshot()])
    assert max_diff(snapshots[0], start) == 0  # epoch 0 ran with lr 0
    assert max_diff(snapshots[1], start) > 1e-3
    lr = callbacks.LRScheduler(lambda s: 0.0, by_step=True)
    model.fit(TensorDataset(list(train_set)), batch_size=25, epochs=1, verbose=0,
              callbacks=[lr])
    assert max_diff(flat_params(model.network), snapshots[1]) == 0
    assert float(lr._variables[0].get_value()) == 0.0

    plain = prepared(tx=optax.sgd(0.1))
    with pytest.raises(fleet.FleetConfigError, match=r"optax.inject_hyperparams"):
        plain.fit(TensorDataset(list(train_set)), verbose=0,
                  callbacks=[callbacks.LRScheduler(lambda e: 0.1)])
    with pytest.raises(fleet.FleetConfigError, match=r"choose exactly one"):
        callbacks.LRScheduler(lambda e: 0.1, by_step=True, by_epoch=True)


def test_progress_bar_prints_on_the_first_worker_only(make_world, train_set, monkeypatch):
    """The console's format is tests/test_hapi_console.py's; here: only the first
    worker prints."""
    make_world(2)
    model = prepared()
    monkeypatch.setattr(_world, "is_first_worker", lambda: False)
    quiet = io.StringIO()
    model.fit(TensorDataset(list(train_set)), batch_size=10, epochs=1,
              callbacks=[callbacks.ProgBarLogger(verbose=2, file=quiet)])
    assert quiet.getvalue() == ""


# -- saving, summary -----------------------------------------------------------------------

def test_save_and_load_resume_training_exactly(make_world, train_set, tmp_path):
    make_world(2)
    ds = TensorDataset(list(train_set))
    a = prepared()
    a.fit(ds, batch_size=8, epochs=1, verbose=0)
    a.save(tmp_path / "ckpt")
    b = Model(Net(nnx.Rngs(7)))
    b.load(tmp_path / "ckpt")  # before prepare: the optimizer state waits for it
    b.prepare(optax.adam(LR), ce, metric.Accuracy())
    assert max_diff(flat_params(b.network), flat_params(a.network)) == 0
    for m in (a, b):
        m.fit(ds, batch_size=8, epochs=1, verbose=0)
    assert max_diff(flat_params(b.network), flat_params(a.network)) == 0  # Adam state too

    wider = prepared(net=Net(nnx.Rngs(0), hidden=16))
    with pytest.raises(fleet.FleetError, match=r"'linear1.kernel': model has \(12, 16\) "
                                               r"float32, given \(12, 32\) float32"):
        wider.load(tmp_path / "ckpt")
    with pytest.warns(fleet.FleetWarning, match=r"skipped 3 saved values"):
        wider.load(tmp_path / "ckpt", skip_mismatch=True, reset_optimizer=True)
    with pytest.raises(fleet.FleetError, match=r"no parameter file at .*nothing\.pdparams"):
        b.load(tmp_path / "nothing")
    other_tx = prepared(tx=optax.sgd(0.1))
    with pytest.raises(fleet.FleetError, match=r"optimizer state does not fit .*"
                                               r"reset_optimizer=True"):
        other_tx.load(tmp_path / "ckpt")


def shape_dtype_struct_with_none():
    try:  # jax 0.11.1 and later refuse None in a ShapeDtypeStruct (fleet/static.py)
        return jax.ShapeDtypeStruct((None, FEATURES), np.float32)
    except ValueError:
        pytest.skip(f"jax {jax.__version__} refuses None in a jax.ShapeDtypeStruct")


@pytest.mark.parametrize("spec", [
    lambda: fleet.static.InputSpec([None, FEATURES], "float32", name="x"),  # the README's
    lambda: jax.ShapeDtypeStruct((1, FEATURES), np.float32),  # every jax
    shape_dtype_struct_with_none,  # the README's form before issue 35 (jax 0.10)
], ids=["InputSpec", "ShapeDtypeStruct", "ShapeDtypeStruct-None"])
def test_summary_counts_parameters(make_world, capsys, spec):
    make_world(1)
    model = Model(Net(nnx.Rngs(0)), inputs=[spec()])
    info = model.summary()
    assert info == {"total_params": 12 * 32 + 32 + 32 * 4 + 4,
                    "trainable_params": 12 * 32 + 32 + 32 * 4 + 4}
    text = capsys.readouterr().out.splitlines()
    # Paddle's table (issue 23): the columns, a row per layer call, the size lines
    assert text[1].split() == ["Layer", "(type)", "Input", "Shape", "Output", "Shape", "Param",
                               "#"]
    rows = [line.split() for line in text[3:5]]
    assert rows == [["Linear-1", "float32[1,12]", "[1,", "32]", "416"],
                    ["Linear-2", "float32[1,32]", "[1,", "4]", "132"]], text
    assert text[6:9] == ["Total params: 548", "Trainable params: 548", "Non-trainable params: 0"]
    assert [line.split(":")[0] for line in text[10:14]] == [
        "Input size (MB)", "Forward/backward pass size (MB)", "Params size (MB)",
        "Estimated Total Size (MB)"]
    model.summary()  # the network is unchanged by it: the same table again
    assert capsys.readouterr().out.splitlines() == text


# -- errors --------------------------------------------------------------------------------

def test_errors_say_what_was_given_and_what_to_do(make_world, train_set):
    make_world(2)
    ds = TensorDataset(list(train_set))
    with pytest.raises(fleet.FleetTypeError, match=r"Linen module Dense; train Linen with "
                                                   r"the four-step API"):
        Model(linen.Dense(3))
    with pytest.raises(fleet.FleetTypeError, match=r"NNX module \(nnx.Module\), got int"):
        Model(3)
    model = Model(Net(nnx.Rngs(0)))
    with pytest.raises(fleet.FleetError, match=r"fit needs an optimizer: call model.prepare"):
        model.fit(ds)
    with pytest.raises(fleet.FleetTypeError, match=r"optax transformation .* got str"):
        model.prepare("adam")
    with pytest.raises(fleet.FleetTypeError, match=r"fleet.metric.Metric objects, got object"):
        model.prepare(optax.adam(LR), ce, [object()])
    with pytest.raises(fleet.FleetConfigError, match=r"metric names \['acc', 'acc'\] repeat"):
        model.prepare(optax.adam(LR), ce, [metric.Accuracy(), metric.Accuracy()])
    model.prepare(optax.adam(LR), None)
    with pytest.raises(fleet.FleetError, match=r"fit needs a loss"):
        model.fit(ds)
    model.prepare(optax.adam(LR), ce)
    with pytest.raises(fleet.FleetTypeError, match=r"train_data must be a dataset .* got "
                                                   r"ndarray; wrap arrays as "
                                                   r"fleet.io.TensorDataset"):
        model.fit(train_set[0])
    with pytest.raises(fleet.FleetConfigError, match=r"batch_size=0 must be at least 1"):
        model.fit(ds, batch_size=0)
    with pytest.raises(fleet.FleetConfigError, match=r"verbose=3 must be 0"):
        model.fit(ds, verbose=3)
    with pytest.raises(fleet.FleetTypeError, match=r"callbacks must be .* got builtin_function_or_method"):
        model.fit(ds, callbacks=[print], verbose=0)
    with pytest.raises(fleet.FleetTypeError, match=r"got a dict with keys \['x', 'y'\]"):
        model.fit(TensorDataset({"x": train_set[0], "y": train_set[1]}), verbose=0)
    model.prepare(optax.adam(LR), lambda logits, y: ce(logits, y)[:3])
    # The step is first traced as the single-device step on the global batch (2 x 5).
    with pytest.raises(fleet.FleetConfigError, match=r"returned shape \(3,\) for a batch of "
                                                     r"10; return a scalar or one value per "
                                                     r"example \(leading axis 10\)"):
        model.evaluate(ds, batch_size=5, verbose=0)


# -- issue 11 §4: a light fleet.Model ------------------------------------------------------

def test_hapi_touches_no_private_attribute_of_the_model_loader_or_sampler():
    """Callbacks, loops and the model talk through public attributes: no `x._name`
    in fleet/hapi except on `self`; and the model's file stays one idea long."""
    import ast
    from pathlib import Path

    hapi = Path(fleet.__file__).parent / "hapi"
    found = []
    for path in sorted(hapi.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
    assert len((hapi / "_model.py").read_text().splitlines()) < 350
