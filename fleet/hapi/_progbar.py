"""The progress bar: step, loss, metrics and samples/s, printed by the first worker.

:class:`ProgressBar` formats and prints; a hand-written loop can use it as it is.
:class:`ProgBarLogger` is the callback ``fleet.Model`` adds when ``verbose > 0``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

import numpy as np

from fleet import _world
from fleet._errors import FleetConfigError
from fleet.hapi._callbacks import Callback
from fleet.hapi._loops import AMP_LOGS


def format_value(value: Any) -> str:
    """``0.1235``, ``1.2e-05``, ``3`` (integers), or a list of those."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    value = np.asarray(value)  # a device array is read here, when printed
    if np.issubdtype(value.dtype, np.integer):
        return str(int(value))
    value = float(value)
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.4e}"
    return f"{value:.4f}"


class ProgressBar:
    """Prints ``step 37/938 [=====>......] - loss: 0.4124 - acc: 0.8531 - 5123 samples/s``.

    With ``verbose=1`` on a terminal, the line is redrawn in place; otherwise
    (``verbose=2``, or output to a file or a launcher's log) every update prints a
    line. Only the first worker prints (``fleet.is_first_worker()``).

    Args:
        num: steps in the run (``None`` when unknown).
        verbose: 1 (a bar redrawn in place on terminals) or 2 (a line per update).
        width: characters of the bar.
        file: where to print (default ``sys.stdout``).
        suffix: appended to every line, e.g. ``"(synthetic data)"``.

    Example:
        >>> bar = ProgressBar(num=2, verbose=2)
        >>> bar.update(1, [("loss", 0.5)], samples=64)  # doctest: +ELLIPSIS
        step 1/2 - loss: 0.5000 - ... samples/s
    """

    def __init__(self, num: int | None = None, verbose: int = 1, width: int = 30,
                 file: TextIO | None = None, suffix: str = ""):
        self.num, self.verbose, self.width, self.suffix = num, verbose, width, suffix
        self.file = file
        self.enabled = _world.is_first_worker()
        self._last_time = time.perf_counter()
        self._drawn = False

    def _out(self) -> TextIO:
        return self.file if self.file is not None else sys.stdout

    def update(self, current: int, values: Iterable[tuple[str, Any]] = (), samples: int = 0) -> None:
        """Shows step ``current`` with ``values``; ``samples`` is the number of samples
        processed since the previous update (for samples/s)."""
        now = time.perf_counter()
        elapsed, self._last_time = now - self._last_time, now
        if not self.enabled:
            return
        total = f"/{self.num}" if self.num else ""
        if self.num:
            digits = len(str(self.num))
            head = f"step {current:>{digits}d}{total}"
        else:
            head = f"step {current}"
        parts = [f"{name}: {format_value(v)}" for name, v in values]
        if samples and elapsed > 0:
            parts.append(f"{samples / elapsed:.0f} samples/s")
        tail = "".join(f" - {p}" for p in parts) + (f" {self.suffix}" if self.suffix else "")
        out = self._out()
        if self.verbose == 1 and self.num and _isatty(out):
            done = int(self.width * current / self.num)
            bar = "=" * max(done - 1, 0) + (">" if done < self.width else "=") if done else ""
            bar = f"[{bar:.<{self.width}}]"
            end = "\n" if current >= self.num else ""
            out.write(f"\r{head} {bar}{tail}{end}")
            self._drawn = current < self.num
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

    ``Epoch 1/5``, then every ``log_freq`` steps and at each epoch's last step:
    the step, the current batch's loss, the metrics so far this epoch, with
    float16 amp the loss scale and the steps skipped so far (``loss_scaling``,
    ``skipped_steps``), and the samples/s (global batch rows over wall time) since
    the previous line. Evaluation prints its exact values at its last step and the
    sample count. Values still on the devices are read only for the lines printed.

    Args:
        log_freq: print every ``log_freq`` steps.
        verbose: 0 silent, 1 a bar (redrawn in place on terminals), 2 lines.
        file: where to print (default ``sys.stdout``).
    """

    def __init__(self, log_freq: int = 1, verbose: int = 2, file: TextIO | None = None):
        super().__init__()
        if not isinstance(log_freq, int) or isinstance(log_freq, bool) or log_freq < 1:
            raise FleetConfigError(f"ProgBarLogger(log_freq={log_freq!r}) must be an int >= 1")
        self.log_freq, self.verbose, self.file = log_freq, verbose, file
        self._bar: ProgressBar | None = None
        self._samples = 0
        self._total = 0

    def _print(self, text: str) -> None:
        if self.verbose and _world.is_first_worker():
            print(text, file=self.file if self.file is not None else sys.stdout, flush=True)

    def _start(self, steps: int | None) -> None:
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

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._print(f"Epoch {epoch + 1}/{self.epochs}")
        self._start(self.steps)

    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._step(step, logs, self.steps, self.names)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._bar is not None:
            self._bar.close()

    # -- evaluation and prediction ----------------------------------------------------

    def _begin(self, what: str, logs: dict | None) -> None:
        logs = logs or {}
        self._eval_steps = logs.get("steps")
        self._eval_names = ["loss", *logs.get("metrics", [])]
        self._print(f"{what} begin...")
        self._start(self._eval_steps)

    def on_eval_begin(self, logs: dict | None = None) -> None:
        self._begin("Eval", logs)

    def on_eval_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._step(step, logs, self._eval_steps, self._eval_names)

    def on_eval_end(self, logs: dict | None = None) -> None:
        self._bar.close()
        self._print(f"Eval samples: {self._total}")

    def on_predict_begin(self, logs: dict | None = None) -> None:
        self._begin("Predict", logs)
        self._eval_names = []

    def on_predict_batch_end(self, step: int, logs: dict | None = None) -> None:
        self._step(step, logs, self._eval_steps, self._eval_names)

    def on_predict_end(self, logs: dict | None = None) -> None:
        self._bar.close()
        self._print(f"Predict samples: {self._total}")
