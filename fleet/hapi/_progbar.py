"""The progress bar in Paddle's format, printed by the first worker.

:class:`ProgressBar` formats and prints; a hand-written loop can use it as it is.
:class:`ProgBarLogger` is the callback ``fleet.Model`` adds when ``verbose > 0``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

import numpy as np

from fleet.hapi._callbacks import Callback, int_arg
from fleet.hapi._loops import AMP_LOGS
from fleet.runtime import _world

OPENING = ("The loss value printed in the log is the current step, and the metric is the "
           "average value of previous steps.")  # Paddle's first line of fit


def format_value(value: Any) -> str:
    """Paddle's: ``0.1235`` (above 1e-3), ``1.2000e-05`` (at most 1e-3, zero
    included), ``3`` (integers); several values separated by spaces."""
    if isinstance(value, (list, tuple)):
        return " ".join(format_value(v) for v in value)
    value = np.asarray(value)  # a device array is read here, when printed
    if np.issubdtype(value.dtype, np.integer) or value.dtype == bool:
        return str(int(value))
    value = float(value)
    return f"{value:.4f}" if abs(value) > 1e-3 else f"{value:.4e}"


def _per_step(seconds: float) -> str:
    """Paddle's time per step: ``2s``, ``46ms`` or ``938us``."""
    if seconds >= 1 or seconds == 0:
        return f"{seconds:.0f}s/step"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/step"
    return f"{seconds * 1e6:.0f}us/step"


def _eta(seconds: float) -> str:
    seconds = int(seconds)
    if seconds > 3600:
        return f"{seconds // 3600}:{seconds % 3600 // 60:02}:{seconds % 60:02}"
    if seconds > 60:
        return f"{seconds // 60}:{seconds % 60:02}"
    return f"{seconds}s"


class ProgressBar:
    """Prints ``step 3/10 [=====>......] - loss: 0.4124 - acc: 0.8531 - ETA: 2s - 46ms/step``.

    Paddle's format: ``verbose=1`` draws the bar and the time left (redrawn in
    place on a terminal; otherwise, as in a launcher's log, a line per update);
    ``verbose=2`` prints ``step 3/10 - loss: 0.4124 - acc: 0.8531 - 46ms/step``.
    The time per step is the mean since the bar started. The last step's line
    (``current == num``) ends with the throughput, `` - 5123 samples/s`` (the
    samples of every update over the time since the start). Only the first
    worker prints (``fleet.is_first_worker()``).

    Args:
        num: steps in the run (``None`` when unknown).
        verbose: 1 (the bar) or 2 (a line per update).
        width: characters of the bar.
        file: where to print (default ``sys.stdout``).
        suffix: appended to every line, e.g. ``"(synthetic data)"``.

    Example:
        >>> bar = ProgressBar(num=2, verbose=2)
        >>> bar.update(1, [("loss", 0.5)], samples=64)  # doctest: +ELLIPSIS
        step 1/2 - loss: 0.5000 - ...s/step
    """

    def __init__(self, num: int | None = None, verbose: int = 1, width: int = 30,
                 file: TextIO | None = None, suffix: str = ""):
        self.num, self.verbose, self.width, self.suffix = num, verbose, width, suffix
        self.file = file
        self.enabled = _world.is_first_worker()
        self._start = time.perf_counter()
        self._samples = 0
        self._drawn = False

    def _out(self) -> TextIO:
        return self.file if self.file is not None else sys.stdout

    def update(self, current: int, values: Iterable[tuple[str, Any]] = (), samples: int = 0) -> None:
        """Shows step ``current`` with ``values``; ``samples`` is the number of samples
        processed since the previous update (for the last line's samples/s)."""
        self._samples += samples
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self._start
        per_step = elapsed / current if current else 0.0
        head = (f"step {current:>{len(str(self.num))}d}/{self.num}" if self.num
                else f"step {current:3d}")
        tail = "".join(f" - {name}: {format_value(v)}" for name, v in values)
        last = bool(self.num) and current >= self.num
        if self.verbose == 1 and self.num and not last:
            tail += f" - ETA: {_eta(per_step * (self.num - current))}"
        tail += f" - {_per_step(per_step)}"
        if last and self._samples and elapsed > 0:
            tail += f" - {self._samples / elapsed:.0f} samples/s"
        tail += f" {self.suffix}" if self.suffix else ""
        out = self._out()
        if self.verbose == 1 and self.num:
            done = int(self.width * min(current / self.num, 1.0))
            bar = "=" * (done - 1) + ("=" if last else ">") if done else ""
            head += f" [{bar:.<{self.width}}]"
        if self.verbose == 1 and self.num and _isatty(out):
            out.write(f"\r{head}{tail}" + ("\n" if last else ""))
            self._drawn = not last
        else:
            out.write(f"{head}{tail}\n")
        out.flush()

    def close(self) -> None:
        """Ends a bar left unfinished on a terminal."""
        if self.enabled and self._drawn:
            self._out().write("\n")
            self._out().flush()
            self._drawn = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class ProgBarLogger(Callback):
    """Prints training and evaluation progress (Paddle's ``ProgBarLogger``).

    Paddle's opening line (:data:`OPENING`), ``Epoch 1/5``, then every
    ``log_freq`` steps and at each epoch's last step (:class:`ProgressBar`): the
    step, the current batch's loss, the metrics so far this epoch, with float16
    amp the loss scale and the steps skipped so far (``loss_scaling``,
    ``skipped_steps``), the time per step, and on the last line the samples/s
    (global batch rows over wall time). Evaluation prints its exact values at its
    last step and the sample count. Values still on the devices are read only
    for the lines printed.

    Args:
        log_freq: print every ``log_freq`` steps.
        verbose: 0 silent, 1 a bar (redrawn in place on terminals), 2 lines.
        file: where to print (default ``sys.stdout``).
    """

    def __init__(self, log_freq: int = 1, verbose: int = 2, file: TextIO | None = None):
        super().__init__()
        self.log_freq = int_arg("ProgBarLogger", "log_freq", log_freq, 1)
        self.verbose, self.file = verbose, file
        self._bar: ProgressBar | None = None
        self._samples = 0
        self._total = 0

    def _print(self, text: str) -> None:
        if self.verbose and _world.is_first_worker():
            print(text, file=self.file if self.file is not None else sys.stdout, flush=True)

    def _begin_bar(self, steps: int | None) -> None:
        self._bar = ProgressBar(steps, self.verbose, file=self.file)
        self._samples = self._total = 0

    def _step(self, step: int, logs: dict | None, steps: int | None, names: list[str]) -> None:
        logs = logs or {}
        self._samples += int(logs.get("batch_size", 0))
        self._total += int(logs.get("batch_size", 0))
        last = steps is not None and step + 1 >= steps
        if self.verbose and ((step + 1) % self.log_freq == 0 or last):
            values = [(k, logs[k]) for k in names if k in logs]
            self._bar.update(step + 1, values, self._samples)
            self._samples = 0

    # -- training ---------------------------------------------------------------------

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.epochs = self.params.get("epochs")
        self.steps = self.params.get("steps")
        self.names = ["loss", *self.params.get("metrics", []), *AMP_LOGS]  # those in logs
        self._print(OPENING)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._print(f"Epoch {epoch + 1}/{self.epochs}")
        self._begin_bar(self.steps)

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._step(step, logs, self.steps, self.names)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._bar is not None:
            self._bar.close()

    # -- evaluation and prediction (a predict's logs have no loss) ---------------------

    def _begin(self, what: str, logs: dict | None) -> None:
        logs = logs or {}
        self._what, self._eval_steps = what, logs.get("steps")
        self._eval_names = ["loss", *logs.get("metrics", [])]
        self._print(f"{what} begin...")
        self._begin_bar(self._eval_steps)

    def on_eval_begin(self, logs: dict | None = None) -> None:
        self._begin("Eval", logs)

    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._begin("Predict", logs)

    def on_eval_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._step(step, logs, self._eval_steps, self._eval_names)

    def on_eval_end(self, logs: dict | None = None) -> None:
        self._bar.close()
        self._print(f"{self._what} samples: {self._total}")

    on_predict_batch_end = on_eval_batch_end
    on_predict_end = on_eval_end
