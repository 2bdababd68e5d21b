"""fleet.Model's console, in Paddle's format, with each step's own numbers (issue 23).

Paddle 3.3.1's ``Model.fit`` prints, for this seed's kind of script::

    The loss value printed in the log is the current step, and the metric is the average
    value of previous steps.      (one line)
    Epoch 1/2
    step 2/5 - loss: 1.3495 - acc_top1: 0.1875 - acc_top2: 0.6250 - 7ms/step
    step 5/5 - loss: 1.3250 - acc_top1: 0.4000 - acc_top2: 0.6250 - 3ms/step
    Eval begin...
    step 3/3 - loss: 1.3199 - acc_top1: 0.2000 - acc_top2: 0.5000 - 1ms/step
    Eval samples: 20

and with ``verbose=1`` the bar: ``step 2/5 [===========>..................] - loss:
1.3495 - ... - ETA: 0s - 7ms/step``. fleet prints the same lines (the last line of
an epoch adds its samples/s). Evaluation lines show the mean loss so far (Paddle's
the batch's).
"""

from __future__ import annotations

import io
import re

import numpy as np
import optax
import pytest
from flax import nnx

from fleet.hapi import Model, callbacks, metric
from fleet.hapi._progbar import format_value
from fleet.io import TensorDataset

N, BATCH = 40, 8  # 5 global batches of 8
TIME = r"\d+(s|ms|us)/step"


def data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((N, 4)).astype(np.float32),
            rng.integers(0, 3, N).astype(np.int32))


def fixed_net():
    net = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    net.kernel[...] = rng.standard_normal((4, 3)).astype(np.float32)
    net.bias[...] = rng.standard_normal(3).astype(np.float32)
    return net


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def fit_output(devices_world, verbose, log_freq=1, file=None) -> list[str]:
    model = Model(fixed_net())
    model.prepare(optax.sgd(0.0), ce, metric.Accuracy(topk=(1, 2)))
    out = file or io.StringIO()
    model.fit(TensorDataset(list(data())), batch_size=BATCH // devices_world, epochs=1,
              shuffle=False, callbacks=[callbacks.ProgBarLogger(log_freq, verbose, file=out)])
    return out.getvalue()


@pytest.mark.parametrize("devices", [1, 4])
def test_each_step_prints_its_own_loss_and_the_metrics_after_it(make_world, devices):
    """lr 0, fixed weights, no shuffle: step k's line holds the loss of step k's rows
    and the accuracy over steps 1..k (Paddle's; fleet showed step k-1's before)."""
    make_world(devices)
    printed = [line for line in fit_output(devices, verbose=2).splitlines()
               if line.startswith("step")]
    x, y = data()
    net = fixed_net()
    logits = np.asarray(net(x))
    losses = np.asarray(ce(logits, y))
    top1 = logits.argmax(1) == y
    top2 = (np.argsort(-logits, 1)[:, :2] == y[:, None]).any(1)
    assert len(printed) == N // BATCH
    for k, line in enumerate(printed):
        rows = slice(k * BATCH, (k + 1) * BATCH)
        seen = slice(0, (k + 1) * BATCH)
        want = (f"step {k + 1}/5 - loss: {losses[rows].mean():.4f} - acc_top1: "
                f"{top1[seen].mean():.4f} - acc_top2: {top2[seen].mean():.4f} - ")
        assert line.startswith(want), (line, want)


def test_verbose_2_lines_have_paddles_shape(make_world):
    make_world(4)
    lines = fit_output(4, verbose=2, log_freq=2).splitlines()
    assert lines[0] == ("The loss value printed in the log is the current step, and the "
                        "metric is the average value of previous steps.")
    assert lines[1] == "Epoch 1/1"
    number = r"\d\.\d{4}"
    for line in lines[2:4]:
        assert re.fullmatch(rf"step [24]/5 - loss: {number} - acc_top1: {number} - acc_top2: "
                            rf"{number} - {TIME}", line), line
    assert re.fullmatch(rf"step 5/5 - loss: {number} - acc_top1: {number} - acc_top2: "
                        rf"{number} - {TIME} - \d+ samples/s", lines[4]), lines[4]


def test_verbose_1_draws_paddles_bar_with_eta(make_world):
    make_world(4)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    logged = fit_output(4, verbose=1, log_freq=2).splitlines()  # not a terminal: lines
    assert re.fullmatch(rf"step 2/5 \[={{11}}>\.{{18}}\] - loss: \d\.\d{{4}} - acc_top1: "
                        rf"\d\.\d{{4}} - acc_top2: \d\.\d{{4}} - ETA: \d+s - {TIME}", logged[2])
    assert re.fullmatch(rf"step 5/5 \[={{30}}\] - loss: .* - {TIME} - \d+ samples/s",
                        logged[4]), logged[4]
    tty = Terminal()
    fit_output(4, verbose=1, log_freq=2, file=tty)
    drawn = tty.getvalue()
    assert "\rstep 2/5 [===========>..................] - loss: " in drawn
    assert "\rstep 4/5 [=======================>......] - loss: " in drawn
    assert re.search(rf"\rstep 5/5 \[={{30}}\] - loss: .* - {TIME} - \d+ samples/s\n$", drawn)


def test_values_are_formatted_as_paddle_does():
    assert [format_value(v) for v in (0.12345, 0.0, 1e-4, 3, [0.5, 0.25], np.int32(7))] == [
        "0.1235", "0.0000e+00", "1.0000e-04", "3", "0.5000 0.2500", "7"]
