"""strategy.amp under fleet.Model, each against a reference.

* bfloat16 on Fashion-MNIST (the MNIST example's network and data, 4 devices):
  the test accuracy within 0.5 point of the float32 run, and the loss curve of
  the first 100 steps within 2% of it (same seed, same batches).
* float16: ``prepare`` builds the distributed optimizer that holds the loss
  scale; the training logs, the progress bar and the history carry
  ``loss_scaling`` and ``skipped_steps``, equal to the optimizer's state and to
  Paddle's scaling rules written out in Python, and only when the loss is scaled.
"""

from __future__ import annotations

import importlib.util
import io
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from fleet.io import TensorDataset
from fleet.runtime import _world
from tests import models
from tests.test_example_mnist import FASHION, require_fashion_mnist
from tests.test_strategy import FP16, paddle_scale_rules
from tests.tiers import slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mnist"


def strategy(**sections) -> fleet.DistributedStrategy:
    s = fleet.DistributedStrategy()
    for name, value in sections.items():
        setattr(s, name, value)
    return s


def mse(outputs, y):
    return ((outputs - y) ** 2).mean(axis=-1)


class Record(fleet.callbacks.Callback):
    """Keeps every training step's logs as they arrive, and the optimizer's
    loss-scale state read at the same moment."""

    def on_train_begin(self, logs=None):
        self.logs, self.state = [], []

    def on_train_batch_end(self, step, logs=None):
        self.logs.append(dict(logs))
        opt = self.model.optimizer
        if getattr(opt, "amp_rules", None) is not None:
            self.state.append((float(opt.loss_scaling[...]), int(opt.skipped_steps[...])))


# -- float16: the distributed optimizer and the logs --------------------------------------------

@pytest.mark.parametrize("given", ["optax", "nnx.Optimizer"])
def test_prepare_builds_the_distributed_optimizer_that_holds_the_scale(make_world, given):
    make_world(2, strategy(amp=True, amp_configs=FP16))
    network = models.LinearNet(nnx.Rngs(0))
    tx = optax.sgd(0.1)
    model = fleet.Model(network)
    model.prepare(tx if given == "optax" else nnx.Optimizer(network, tx, wrt=nnx.Param), mse)
    assert isinstance(model.optimizer, fleet.DistributedOptimizer)
    assert model.optimizer.amp_rules is not None
    assert float(model.optimizer.loss_scaling[...]) == 1024.0
    assert int(model.optimizer.skipped_steps[...]) == 0


def test_fp16_logs_carry_the_optimizers_loss_scale_and_skipped_steps(make_world):
    """11 steps on 4 replicas, 4 of them with an inf in one replica's rows: the
    logs of every step hold the optimizer's scale and skip count (still on the
    devices: the loop does not read them), which follow Paddle's rules; the
    progress bar prints them every log_freq steps, the history keeps the last."""
    make_world(4, strategy(amp=True, amp_configs=FP16))
    finite = [True, True, False, False, True, False, True, True, True, False, True]
    global_batch = 8  # 2 rows per replica
    rng = np.random.RandomState(0)
    x = rng.randn(len(finite) * global_batch, 10).astype(np.float32)
    y = rng.randn(len(finite) * global_batch, 1).astype(np.float32)
    for step, ok in enumerate(finite):
        if not ok:
            x[step * global_batch + 2, 0] = np.inf  # replica 1's rows only
    model = fleet.Model(models.LinearNet(nnx.Rngs(0)))
    model.prepare(optax.adam(1e-2), mse)
    record, out = Record(), io.StringIO()
    bar = fleet.callbacks.ProgBarLogger(log_freq=3, verbose=2, file=out)
    history = model.fit(TensorDataset([x, y]), batch_size=2, shuffle=False,
                        callbacks=[bar, record])

    scales = paddle_scale_rules(finite, 1024.0, 2, 2, 2.0, 0.5)
    skipped = [int(n) for n in np.cumsum([not ok for ok in finite])]
    print("scales:", scales, "skipped:", skipped)
    print(out.getvalue(), end="")
    for logs in record.logs:
        assert isinstance(logs["loss_scaling"], jax.Array)
        assert isinstance(logs["skipped_steps"], jax.Array)
    got = [(float(g["loss_scaling"]), int(g["skipped_steps"])) for g in record.logs]
    assert got == record.state == list(zip(scales, skipped))
    opt = model.optimizer
    assert int(opt.step[...]) == finite.count(True)
    assert history[0]["loss_scaling"] == float(opt.loss_scaling[...]) == scales[-1]
    assert history[0]["skipped_steps"] == int(opt.skipped_steps[...]) == skipped[-1]
    assert isinstance(history[0]["skipped_steps"], int)

    lines = re.findall(r"step +(\d+)/11 - (.*)", out.getvalue())
    assert [int(s) for s, _ in lines] == [3, 6, 9, 11]
    for s, text in lines:
        want = f"loss_scaling: {scales[int(s) - 1]:.4f} - skipped_steps: {skipped[int(s) - 1]}"
        assert want in text, (want, text)


STATIC_FP16 = {"dtype": "float16", "use_dynamic_loss_scaling": False, "init_loss_scaling": 128.0}


@pytest.mark.parametrize("amp_configs", [None, {}, STATIC_FP16], ids=["fp32", "bf16", "fp16-static"])
def test_the_loss_scale_is_logged_exactly_when_the_loss_is_scaled(make_world, amp_configs):
    make_world(2, None if amp_configs is None else strategy(amp=True, amp_configs=amp_configs))
    rng = np.random.RandomState(1)
    data = TensorDataset([rng.randn(16, 10).astype(np.float32),
                          rng.randn(16, 1).astype(np.float32)])
    model = fleet.Model(models.LinearNet(nnx.Rngs(0)))
    model.prepare(optax.sgd(0.01), mse)
    record, out = Record(), io.StringIO()
    bar = fleet.callbacks.ProgBarLogger(log_freq=1, verbose=2, file=out)
    history = model.fit(data, batch_size=4, callbacks=[bar, record])
    scaled = amp_configs is STATIC_FP16
    assert (model.optimizer.amp_rules is not None) == scaled
    for logs in [*record.logs, history[0]]:
        assert ("loss_scaling" in logs) == ("skipped_steps" in logs) == scaled
    assert ("loss_scaling" in out.getvalue()) == scaled
    if scaled:  # static scaling: the scale stays at its start, nothing is skipped
        assert (history[0]["loss_scaling"], history[0]["skipped_steps"]) == (128.0, 0)


# -- bfloat16 on Fashion-MNIST: accuracy and loss curve against float32 -------------------------

def _load_example() -> tuple:
    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    data = load("mnist_example_data", EXAMPLE / "data.py")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "data", data)  # what train.py imports as `data`
        train = load("mnist_example_train", EXAMPLE / "train.py")
    return data, train


NUM_TRAIN, BATCH, DEVICES = 12800, 16, 4  # 200 steps of 64


@pytest.fixture(scope="module")
def fashion_runs():
    """The example's MLP (no dropout) trained one epoch on the first 12,800
    Fashion-MNIST training images, on 4 devices, in float32 and with ``--amp``
    (bfloat16); same seed, same shuffled batches. Each run's per-step losses and
    its accuracy on the 10,000 test images."""
    require_fashion_mnist()
    _, train = _load_example()
    train_set = train.dataset(str(FASHION), "train", NUM_TRAIN)
    test_set = train.dataset(str(FASHION), "test", None)
    runs = {}
    for amp in (False, True):
        args = train.parse_args(["--dataset", "fashion", "--dropout", "0"]
                                + (["--amp"] if amp else []))
        _world._WORLD = None
        try:
            fleet.init(is_collective=True, strategy=train.strategy_of(args),
                       devices=jax.devices()[:DEVICES])
            model = fleet.Model(train.MLP(nnx.Rngs(args.seed), args.dropout))
            want = jnp.bfloat16 if amp else None  # None: Flax computes in the params' dtype
            assert model.network.linear1.dtype == want
            assert model.network.linear1.kernel[...].dtype == jnp.float32
            model.prepare(optax.adam(args.lr), optax.softmax_cross_entropy_with_integer_labels,
                          fleet.metric.Accuracy())
            record = Record()
            model.fit(train_set, batch_size=BATCH, epochs=1, verbose=0, callbacks=[record])
            acc = model.evaluate(test_set, batch_size=250, verbose=0)["acc"]
        finally:
            _world._WORLD = None
        runs["bf16" if amp else "fp32"] = (np.array([float(g["loss"]) for g in record.logs]),
                                           acc)
    return runs


@slow  # trains on Fashion-MNIST for an epoch, twice
def test_bf16_fashion_mnist_accuracy_within_half_a_point_of_fp32(fashion_runs):
    fp32, bf16 = fashion_runs["fp32"][1], fashion_runs["bf16"][1]
    print(f"Fashion-MNIST test accuracy, 1 epoch on {NUM_TRAIN} images, {DEVICES} devices: "
          f"fp32 {fp32:.4f}, bf16 amp {bf16:.4f} (difference {100 * (bf16 - fp32):+.2f} points)")
    assert fp32 > 0.78 and bf16 > 0.78  # both learned (one epoch on a fifth of the data)
    assert abs(bf16 - fp32) <= 0.005


@slow  # trains on Fashion-MNIST for an epoch, twice
def test_bf16_fashion_mnist_loss_curve_within_2_percent_of_fp32(fashion_runs):
    """The curve compared is the loss averaged over a sliding window of 10 steps
    (the smoothed curve one plots). Single steps are compared too, and printed:
    the two runs' parameters drift apart by bfloat16's rounding, so one batch's
    loss can differ by a few percent while the curve does not."""
    fp32, bf16 = (fashion_runs[k][0][:100] for k in ("fp32", "bf16"))
    assert len(fp32) == len(bf16) == 100
    window = np.ones(10) / 10
    smooth32, smooth16 = np.convolve(fp32, window, "valid"), np.convolve(bf16, window, "valid")
    curve = float(np.max(np.abs(smooth16 - smooth32) / smooth32))
    step = np.abs(bf16 - fp32) / fp32
    print(f"loss, first 100 steps: max relative difference bf16 vs fp32 of the 10-step mean "
          f"{curve:.4f}; of single steps {step.max():.4f} (median {np.median(step):.4f}); "
          f"loss {fp32[0]:.3f} -> {smooth32[-1]:.3f}")
    assert step.max() > 0  # bfloat16 did change the computation
    assert smooth32[-1] < 0.5 * fp32[0]  # the curve falls: it is a training curve
    assert curve <= 0.02


@slow
def test_the_composed_strategy_through_fleet_model_equals_the_low_level_loop(make_world):
    """fleet.Model with amp, recompute, gradient_merge, LAMB and fp16_allreduce
    (and one update=False call, its no_sync) trains what the low-level loop with
    the same strategy trains (tests/workers/strategy_train.py, the fleetrun run's
    reference)."""
    from tests.workers import strategy_train as worker

    make_world(4, worker.strategy())
    expected = worker.train()

    make_world(4, worker.strategy())
    model = fleet.Model(models.CNN(nnx.Rngs(0)))
    model.prepare(fleet.optimizer.Adam(learning_rate=1e-2),
                  optax.softmax_cross_entropy_with_integer_labels)
    losses = [model.train_batch(x, y, update=i not in worker.NO_SYNC_CALLS)[0]
              for i, (x, y) in enumerate(models.batches("cnn", worker.STEPS, worker.BATCH))]
    got = {"p" + k: v for k, v in models.flat_params(model.network).items()}
    d_params = models.max_diff(got, {k: expected[k] for k in got})
    d_loss = float(np.abs(np.ravel(losses) - expected["losses"]).max())
    print(f"composed strategy, fleet.Model vs the low-level loop: |params| = {d_params:.2e}, "
          f"|losses| = {d_loss:.2e}")
    assert int(model.optimizer.step[...]) == int(expected["optimizer_steps"]) == 3
    assert d_params < 1e-6 and d_loss < 1e-6
