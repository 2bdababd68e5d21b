"""Callbacks for :class:`fleet.Model` (Paddle's ``paddle.callbacks``).

:class:`Callback` is the hook for user code: subclass it and override the
``on_*`` methods you need. ``fit`` calls, in this order::

    on_train_begin
      on_epoch_begin(epoch)
        on_train_batch_begin(step) / on_train_batch_end(step, logs)   (every step)
      on_epoch_end(epoch, logs)
      on_eval_begin / on_eval_batch_* / on_eval_end(logs)             (every eval_freq)
    on_train_end

Every process runs every callback (a checkpoint is a collective step); printing
and writing files happen on the first worker only. ``logs`` holds ``loss``, the
metric values by name, ``step`` and ``batch_size`` (the global batch rows). In
training, with float16 ``strategy.amp`` (when the distributed optimizer scales the
loss), it also holds ``loss_scaling`` (the scale after the step) and
``skipped_steps`` (the steps skipped for non-finite gradients since the optimizer
was built). The training ``loss`` and these two are device arrays: ``float(...)``
reads them, and waits for the step; a callback that reads them every step makes
every step wait.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from fleet._errors import FleetConfigError, FleetTypeError
from fleet.checkpoint import CheckpointManager
from fleet.runtime import _world

_MODES = ("train", "eval", "predict")


class Callback:
    """Base class of callbacks: every hook does nothing until overridden.

    ``self.model`` is the :class:`fleet.Model` and ``self.params`` the run's
    settings (``epochs``, ``steps``, ``batch_size``, ``verbose``, ``metrics``,
    ``log_freq``, ``save_dir``, ``save_freq``).

    Example:
        >>> class LossHistory(Callback):
        ...     def on_train_begin(self, logs=None):
        ...         self.losses = []
        ...     def on_train_batch_end(self, step, logs=None):
        ...         self.losses.append(float(logs["loss"]))
        >>> # model.fit(train_dataset, callbacks=[LossHistory()])
    """

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    def set_model(self, model: Any) -> None:
        self.model = model

    def on_begin(self, mode: str, logs: dict | None = None) -> None:
        getattr(self, f"on_{mode}_begin")(logs)

    def on_end(self, mode: str, logs: dict | None = None) -> None:
        getattr(self, f"on_{mode}_end")(logs)

    def on_batch_begin(self, mode: str, step: int, logs: dict | None = None) -> None:
        getattr(self, f"on_{mode}_batch_begin")(step, logs)

    def on_batch_end(self, mode: str, step: int, logs: dict | None = None) -> None:
        getattr(self, f"on_{mode}_batch_end")(step, logs)

    def on_train_begin(self, logs: dict | None = None) -> None: ...
    def on_train_end(self, logs: dict | None = None) -> None: ...
    def on_eval_begin(self, logs: dict | None = None) -> None: ...
    def on_eval_end(self, logs: dict | None = None) -> None: ...
    def on_predict_begin(self, logs: dict | None = None) -> None: ...
    def on_predict_end(self, logs: dict | None = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None: ...
    def on_train_batch_begin(self, step: int, logs: dict | None = None) -> None: ...
    def on_train_batch_end(self, step: int, logs: dict | None = None) -> None: ...
    def on_eval_batch_begin(self, step: int, logs: dict | None = None) -> None: ...
    def on_eval_batch_end(self, step: int, logs: dict | None = None) -> None: ...
    def on_predict_batch_begin(self, step: int, logs: dict | None = None) -> None: ...
    def on_predict_batch_end(self, step: int, logs: dict | None = None) -> None: ...


class CallbackList:
    """Calls every callback's hook in order."""

    def __init__(self, callbacks: Sequence[Callback]):
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args: Any) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(*args)

        return call


class ModelCheckpoint(Callback):
    """Saves the training state every ``save_freq`` epochs, and the model at the end.

    Every ``save_freq``-th epoch goes through :class:`fleet.CheckpointManager` into
    ``{save_dir}/{epochs done}``: the network (every variable), the optimizer, the
    training loader's position and the epoch, written by every process, each array
    once, atomically. ``fit(resume=True)`` continues from the newest one. At the end
    of training the model is also saved as :meth:`fleet.Model.save` writes it, to
    ``{save_dir}/final`` (``.pdparams``, ``.pdopt``). Nothing is saved when
    ``save_dir`` is ``None``. ``fit(save_dir=..., save_freq=...)`` adds one of these
    by itself.

    Args:
        save_freq: save after every ``save_freq``-th epoch.
        save_dir: the directory.
        max_to_keep: keep only the newest epoch checkpoints (default: all).
    """

    def __init__(self, save_freq: int = 1, save_dir: str | os.PathLike | None = None,
                 max_to_keep: int | None = None):
        super().__init__()
        self.save_freq = int_arg("ModelCheckpoint", "save_freq", save_freq, 1)
        self.save_dir = None if save_dir is None else os.fspath(save_dir)
        self.max_to_keep = max_to_keep
        self.loader: Any = None  # fit sets the training loader
        self._manager: Any = None

    def manager(self) -> Any:
        if self._manager is None:
            self._manager = CheckpointManager(self.save_dir, max_to_keep=self.max_to_keep)
        return self._manager

    def restore_latest(self) -> int:
        """Loads the newest epoch checkpoint into the model, its optimizer and the
        loader; returns the number of epochs it had done (0 if there is none)."""
        restored = self.manager().restore_latest(
            model=self.model.network, optimizer=self.model.optimizer, loader=self.loader)
        return 0 if restored is None else int(restored.epoch)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_dir is not None and (epoch + 1) % self.save_freq == 0:
            self.manager().save(epoch + 1, model=self.model.network,
                                optimizer=self.model.optimizer, loader=self.loader,
                                epoch=epoch + 1, force=True)

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.save_dir is not None:
            self.manager().close()  # waits for an asynchronous save to finish
            self._manager = None
            self.model.save(os.path.join(self.save_dir, "final"))


class EarlyStopping(Callback):
    """Stops ``fit`` when an evaluation value stops improving (Paddle's semantics).

    After each evaluation, ``logs[monitor]`` is compared with the best so far; an
    improvement of more than ``min_delta`` resets the count, anything else adds
    one. When the count exceeds ``patience``, training stops after this epoch.
    With ``save_best_model`` the best model goes to ``{save_dir}/best_model``.

    Args:
        monitor: an evaluation value: ``"loss"`` or a metric name (``"acc"``).
        mode: ``"min"``, ``"max"``, or ``"auto"`` (``max`` for names containing
            ``acc``, else ``min``).
        patience: evaluations without improvement that are tolerated.
        verbose: 1 prints when training stops (first worker only).
        min_delta: the smallest change that counts as an improvement.
        baseline: a value the monitored quantity must beat to count at all.
        save_best_model: save the best model when ``fit`` has a ``save_dir``.

    Example:
        >>> stop = EarlyStopping(monitor="acc", patience=2)
        >>> # model.fit(train, eval_data=test, epochs=50, callbacks=[stop])
    """

    def __init__(
        self,
        monitor: str = "loss",
        mode: str = "auto",
        patience: int = 0,
        verbose: int = 1,
        min_delta: float = 0.0,
        baseline: float | None = None,
        save_best_model: bool = True,
    ):
        super().__init__()
        if mode not in ("auto", "min", "max"):
            raise FleetConfigError(
                f"EarlyStopping(mode={mode!r}) must be 'auto', 'min' or 'max'"
            )
        patience = int_arg("EarlyStopping", "patience", patience, 0)
        self.monitor, self.patience, self.verbose = monitor, patience, verbose
        self.baseline, self.save_best_model = baseline, save_best_model
        if mode == "auto":
            mode = "max" if "acc" in monitor else "min"
        self.mode = mode
        self.min_delta = abs(min_delta)
        self.wait_epoch, self.stopped_epoch, self.best_value = 0, 0, None

    def _better(self, current: float, best: float) -> bool:
        if self.mode == "max":
            return current - self.min_delta > best
        return current + self.min_delta < best

    def on_train_begin(self, logs: dict | None = None) -> None:
        names = ["loss", *self.params.get("metrics", [])]
        if self.monitor not in names:
            raise FleetConfigError(
                f"EarlyStopping(monitor={self.monitor!r}) is not among the evaluation "
                f"values {names}; monitor one of them"
            )
        self.wait_epoch, self.stopped_epoch = 0, 0
        if self.baseline is not None:
            self.best_value = self.baseline
        else:
            self.best_value = -math.inf if self.mode == "max" else math.inf
        self._epoch = 0

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_eval_end(self, logs: dict | None = None) -> None:
        if not logs or self.monitor not in logs:
            return  # an evaluate() outside fit
        current = logs[self.monitor]
        if isinstance(current, (list, tuple)):
            current = current[0]
        if self._better(float(current), self.best_value):
            self.best_value = float(current)
            self.wait_epoch = 0
            save_dir = self.params.get("save_dir")
            if self.save_best_model and save_dir is not None:
                self.model.save(os.path.join(save_dir, "best_model"))
        else:
            self.wait_epoch += 1
        if self.wait_epoch > self.patience:
            self.model.stop_training = True
            self.stopped_epoch = self._epoch
            if self.verbose and _world.is_first_worker():
                print(f"Epoch {self._epoch + 1}: early stopping ({self.monitor} has not "
                      f"improved on {self.best_value:.6g} for {self.wait_epoch} evaluations)",
                      flush=True)


class LRScheduler(Callback):
    """Sets the learning rate from the host, each epoch or each step.

    ``schedule(count) -> lr`` gets the epoch number (``by_epoch``) or the global
    step number (``by_step``), counted from 0, and the value is written into the
    optimizer's ``learning_rate`` hyperparameter before the epoch / step. The
    optimizer must expose it: build it with ``optax.inject_hyperparams``.

    A schedule that depends only on the step count needs no callback: give it to
    optax directly (``optax.adam(optax.cosine_decay_schedule(1e-3, 1000))``).

    Args:
        schedule: a function of the epoch (or step) number returning the rate.
        by_step: update before every step.
        by_epoch: update before every epoch (the default).

    Example:
        >>> import optax
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        >>> lr = LRScheduler(lambda epoch: 0.1 * 0.5 ** epoch)
        >>> # model.prepare(tx, loss); model.fit(train, epochs=5, callbacks=[lr])
    """

    def __init__(self, schedule: Callable[[int], float], by_step: bool = False,
                 by_epoch: bool | None = None):
        super().__init__()
        if not callable(schedule):
            raise FleetTypeError(
                f"LRScheduler takes a function of the epoch or step number, got "
                f"{type(schedule).__name__}; e.g. LRScheduler(lambda epoch: 0.1 * 0.9 ** epoch)"
            )
        if by_epoch is None:
            by_epoch = not by_step
        if by_step == by_epoch:
            raise FleetConfigError(
                f"LRScheduler(by_step={by_step}, by_epoch={by_epoch}): choose exactly one"
            )
        self.schedule, self.by_step = schedule, by_step
        self._step = 0
        self._variables: list = []

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._variables = learning_rate_variables(self.model.optimizer)
        self._step = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if not self.by_step:
            self._set(self.schedule(epoch))

    def on_train_batch_begin(self, step: int, logs: dict | None = None) -> None:
        if self.by_step:
            self._set(self.schedule(self._step))
            self._step += 1

    def _set(self, lr: Any) -> None:
        """Writes ``lr`` into the variables, replicated on the mesh (every process
        calls this with the same value)."""
        sharding = _world.world().replicated
        for var in self._variables:
            host = np.asarray(lr, dtype=var.get_value().dtype)
            var.set_value(jax.make_array_from_callback((), sharding, lambda idx, h=host: h))


def learning_rate_variables(optimizer: Any) -> list:
    """The ``learning_rate`` hyperparameters (``optax.inject_hyperparams``) of an
    ``nnx.Optimizer``'s state; raises when there is none."""
    found = []
    if optimizer is not None:
        for path, var in nnx.to_flat_state(nnx.state(optimizer)):
            if len(path) >= 2 and tuple(map(str, path[-2:])) == ("hyperparams", "learning_rate"):
                found.append(var)
    if not found:
        raise FleetConfigError(
            "LRScheduler needs an optimizer whose learning rate can be set: build it with "
            "optax.inject_hyperparams, e.g. optax.inject_hyperparams(optax.adam)"
            "(learning_rate=1e-3), and pass that to Model.prepare; or give the schedule "
            "to optax directly (optax.adam(optax.exponential_decay(...))), no callback needed"
        )
    return found


def int_arg(cls: str, name: str, value: Any, low: int) -> int:
    """A callback's int argument, refused unless it is ``>= low``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise FleetConfigError(f"{cls}({name}={value!r}) must be an int >= {low}")
    return int(value)
