"""``fleet.Model``: Paddle's high-level ``paddle.Model`` on a data-parallel mesh.

The script is the single-device one; the launcher alone makes it distributed::

    model = fleet.Model(MLP(nnx.Rngs(0)))
    model.prepare(optax.adam(1e-3), optax.softmax_cross_entropy_with_integer_labels,
                  fleet.metric.Accuracy())
    model.fit(train_dataset, test_dataset, epochs=5, batch_size=64)
    model.evaluate(test_dataset, batch_size=64)

``python train.py`` trains on every local device; ``fleetrun --nproc_per_node 2
train.py`` on every device of both processes. ``fleet.Model`` calls
``fleet.init(is_collective=True)`` itself when the script did not.

What happens underneath is the four-step API: the network is wrapped with
``fleet.distributed_model``, the optimizer with ``fleet.distributed_optimizer``,
and the steps (``fleet/hapi/_steps.py``) run through ``fleet.distributed_step``.
A dataset gets a ``DistributedBatchSampler`` (``batch_size`` per device), so
each global batch is the one a single device would take with ``batch_size x
replicas`` rows, and the trained parameters are the single device's.
Evaluation and prediction drop the samples the sampler repeated as padding, so
metrics are exact and predictions come back once each, in dataset order.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import linen, nnx

from fleet import _world
from fleet._errors import FleetConfigError, FleetError, FleetTypeError, FleetWarning
from fleet._model import DataParallel, distributed_model
from fleet._optimizer import distributed_optimizer
from fleet.hapi import _saving, _steps
from fleet.hapi._callbacks import Callback, CallbackList, ModelCheckpoint
from fleet.hapi._inputs import (
    as_tuple,
    check_verbose,
    count_inputs,
    global_rows,
    int_at_least,
    make_loader,
    split_batch,
)
from fleet.hapi._metric import Metric
from fleet.hapi._progbar import ProgBarLogger
from fleet.hapi._summary import summary as _summary
from fleet.io._loader import _to_host

_NEEDS_PREPARE = (
    "call model.prepare(optimizer, loss, metrics) before {what}, e.g. "
    "model.prepare(optax.adam(1e-3), optax.softmax_cross_entropy_with_integer_labels, "
    "fleet.metric.Accuracy())"
)


class Model:
    """A network with its training loop: ``prepare``, ``fit``, ``evaluate``, ``predict``.

    Args:
        network: a Flax NNX module (or a ``fleet.DataParallel`` of one). It is
            wrapped with ``fleet.distributed_model``: its variables are replicated
            on the mesh and updated in place by training.
        inputs: how many leading fields of each sample are the network's inputs
            (an int, or a list with one ``jax.ShapeDtypeStruct`` per input, as
            Paddle's ``InputSpec`` list); the remaining fields are the labels.
            Default: the number of required arguments of ``network.__call__``.
        labels: accepted for Paddle scripts; the labels are the fields after the
            inputs.

    Example:
        >>> model = fleet.Model(MLP(nnx.Rngs(0)))  # doctest: +SKIP
        >>> model.prepare(optax.adam(1e-3), optax.softmax_cross_entropy_with_integer_labels,
        ...               fleet.metric.Accuracy())
        >>> model.fit(train_dataset, epochs=1, batch_size=32)
        >>> model.evaluate(test_dataset)["acc"]
        0.8712
    """

    def __init__(self, network: Any, inputs: Any = None, labels: Any = None):
        del labels
        if isinstance(network, linen.Module):
            raise FleetTypeError(
                f"fleet.Model takes a Flax NNX module, got the Linen module "
                f"{type(network).__name__}; convert it with flax.nnx.bridge.ToNNX, or train "
                "Linen with the four-step API (fleet.distributed_model / distributed_step)"
            )
        if not isinstance(network, nnx.Module):
            raise FleetTypeError(
                f"fleet.Model takes a Flax NNX module (nnx.Module), got "
                f"{type(network).__name__}"
            )
        if not _world.is_initialized():
            _world.init(is_collective=True)
        self.network = network if isinstance(network, DataParallel) else distributed_model(network)
        self._num_inputs = count_inputs(network, inputs)
        self._inputs = inputs
        self._optimizer: Any = None
        self._loss: Any = None
        self._metrics: list[Metric] = []
        self._steps: dict[str, Any] = {}
        self._pending_opt_state: dict | None = None
        self.stop_training = False
        self.history: list[dict[str, Any]] = []

    # -- set-up -------------------------------------------------------------------------

    def prepare(self, optimizer: Any = None, loss: Any = None,
                metrics: Metric | Sequence[Metric] | None = None) -> None:
        """Sets the optimizer, the loss and the metrics.

        Args:
            optimizer: an optax transformation (``optax.adam(1e-3)``; applied to the
                network's ``nnx.Param`` variables) or an ``nnx.Optimizer`` built on
                the network. ``None`` is enough for ``evaluate`` / ``predict``.
            loss: ``loss(outputs, *labels)`` returning one value per example (as
                optax's losses do) or their mean. ``fit`` minimises its mean.
            metrics: a :class:`fleet.metric.Metric` or a list of them.
        """
        if optimizer is not None:
            if isinstance(optimizer, nnx.Optimizer):
                optimizer = distributed_optimizer(optimizer)
            elif isinstance(optimizer, optax.GradientTransformation):
                optimizer = distributed_optimizer(
                    nnx.Optimizer(self.network, optimizer, wrt=nnx.Param))
            else:
                raise FleetTypeError(
                    f"prepare(optimizer=...) takes an optax transformation (e.g. "
                    f"optax.adam(1e-3)) or an nnx.Optimizer, got {type(optimizer).__name__}"
                )
        if loss is not None and not callable(loss):
            raise FleetTypeError(
                f"prepare(loss=...) takes a function loss(outputs, *labels), got "
                f"{type(loss).__name__}; e.g. optax.softmax_cross_entropy_with_integer_labels"
            )
        if metrics is None:
            metrics = []
        elif isinstance(metrics, Metric):
            metrics = [metrics]
        metrics = list(metrics)
        for m in metrics:
            if not isinstance(m, Metric):
                raise FleetTypeError(
                    f"prepare(metrics=...) takes fleet.metric.Metric objects, got "
                    f"{type(m).__name__}; e.g. fleet.metric.Accuracy()"
                )
        names = [n for m in metrics for n in m.name()]
        if len(set(names)) != len(names) or "loss" in names:
            raise FleetConfigError(
                f"metric names {names} repeat (or use 'loss'); give each metric its own "
                "name, e.g. Accuracy(topk=(1, 5), name='acc5')"
            )
        self._optimizer, self._loss, self._metrics = optimizer, loss, metrics
        self._steps = {}
        if self._pending_opt_state is not None and optimizer is not None:
            _saving.set_optimizer_state_dict(optimizer, self._pending_opt_state)
            self._pending_opt_state = None

    def _step(self, kind: str) -> Any:
        if kind not in self._steps:
            if kind == "train":
                self._steps[kind] = _steps.make_train_step(self._loss, self._metrics)
            elif kind == "eval":
                self._steps[kind] = _steps.make_eval_step(self._loss, self._metrics)
            else:
                self._steps[kind] = _steps.make_predict_step()
        return self._steps[kind]

    def _metrics_name(self) -> list[str]:
        return [n for m in self._metrics for n in m.name()]

    # -- one batch ----------------------------------------------------------------------

    def train_batch(self, inputs: Any, labels: Any = None, update: bool = True) -> Any:
        """One training step on a global batch; returns ``[loss]``, or ``([loss],
        metric values)`` with metrics. ``update=False`` accumulates the gradients
        (``no_sync``); the next step with ``update=True`` applies them all."""
        self._check_ready("train_batch", need_optimizer=True)
        self.network.train()
        loss, rows = self._train_call(as_tuple(inputs), as_tuple(labels), update)
        values = [m.update(*jax.tree.map(_to_host, r)) for m, r in zip(self._metrics, rows)]
        return ([float(loss)], values) if self._metrics else [float(loss)]

    def eval_batch(self, inputs: Any, labels: Any = None) -> Any:
        """Loss and metric values of one global batch (no padding is assumed)."""
        self._check_ready("eval_batch", need_loss=False)
        self.network.eval()
        losses, rows = self._step("eval")(self.network, as_tuple(inputs), as_tuple(labels))
        values = [m.update(*jax.tree.map(_to_host, r)) for m, r in zip(self._metrics, rows)]
        loss = [float(np.mean(_to_host(losses)))] if losses is not None else []
        return (loss, values) if self._metrics else loss

    def predict_batch(self, inputs: Any) -> list[np.ndarray]:
        """The network's outputs for one global batch, as host arrays."""
        self.network.eval()
        out = jax.tree.map(_to_host, self._step("predict")(self.network, as_tuple(inputs)))
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _train_call(self, inputs: tuple, labels: tuple, update: bool) -> Any:
        step = self._step("train")
        if update:
            return step(self.network, self._optimizer, inputs, labels)
        with self.network.no_sync():
            return step(self.network, self._optimizer, inputs, labels)

    # -- loops --------------------------------------------------------------------------

    def fit(
        self,
        train_data: Any = None,
        eval_data: Any = None,
        batch_size: int = 1,
        epochs: int = 1,
        eval_freq: int = 1,
        log_freq: int = 10,
        save_dir: str | os.PathLike | None = None,
        save_freq: int = 1,
        verbose: int = 1,
        drop_last: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
        callbacks: Sequence[Callback] | None = None,
        accumulate_grad_batches: int = 1,
        num_iters: int | None = None,
        resume: bool = False,
    ) -> list[dict[str, Any]]:
        """Trains for ``epochs`` epochs, evaluating every ``eval_freq`` epochs.

        Args:
            train_data: a dataset (``__len__``, ``__getitem__``; it gets a
                ``DistributedBatchSampler``) or a ``fleet.io.DataLoader`` (used as it is).
            eval_data: the same, evaluated after every ``eval_freq``-th epoch and
                after the last one.
            batch_size: samples per device per step (the global batch is
                ``batch_size * fleet.num_replicas()``).
            epochs: passes over ``train_data``.
            eval_freq: evaluate every ``eval_freq`` epochs.
            log_freq: print progress every ``log_freq`` steps.
            save_dir: save the model there every ``save_freq`` epochs and at the end.
            save_freq: see ``save_dir``.
            verbose: 0 silent, 1 progress bar, 2 one line per ``log_freq`` steps.
            drop_last: drop the last, smaller batch of each epoch.
            shuffle: reshuffle the training data every epoch.
            num_workers: loader worker processes (0: load in this process).
            callbacks: :class:`fleet.callbacks.Callback` objects.
            accumulate_grad_batches: update every ``k`` steps with the gradients of
                all ``k`` (their mean: one step on the union of the batches).
            num_iters: stop after this many steps (overrides ``epochs``).
            resume: continue from the newest epoch checkpoint in ``save_dir``
                (network, optimizer, loader position), if there is one: a job
                restarted by ``fleetrun --max_restarts`` goes on where it stopped.

        Returns:
            One dict per epoch: ``epoch``, the training ``loss`` (mean over the
            epoch's examples) and metrics, and ``eval_*`` values when evaluated.
        """
        self._check_ready("fit", need_optimizer=True, need_loss=True)
        batch_size = int_at_least("batch_size", batch_size, 1)
        epochs = int_at_least("epochs", epochs, 1)
        eval_freq = int_at_least("eval_freq", eval_freq, 1)
        log_freq = int_at_least("log_freq", log_freq, 1)
        accumulate = int_at_least("accumulate_grad_batches", accumulate_grad_batches, 1)
        if num_iters is not None:
            num_iters = int_at_least("num_iters", num_iters, 1)
        check_verbose(verbose)
        train_loader, own_train = make_loader(train_data, batch_size, shuffle, drop_last,
                                           num_workers, "train_data")
        eval_loader, own_eval = (None, False) if eval_data is None else make_loader(
            eval_data, batch_size, False, False, num_workers, "eval_data")
        try:
            steps = len(train_loader)
            if num_iters is not None:
                epochs = math.ceil(num_iters / steps)
            cbks = self._callbacks(callbacks, verbose, log_freq, {
                "epochs": epochs, "steps": steps, "batch_size": batch_size,
                "verbose": verbose, "metrics": self._metrics_name(), "log_freq": log_freq,
                "save_dir": None if save_dir is None else os.fspath(save_dir),
                "save_freq": save_freq,
            }, save_dir, save_freq)
            start_epoch = self._resume_point(cbks, train_loader, resume)
            self.stop_training = False
            self.history = []
            done = 0
            cbks.on_begin("train")
            logs: dict[str, Any] = {}
            for epoch in range(start_epoch, epochs):
                limit = None if num_iters is None else num_iters - done
                cbks.on_epoch_begin(epoch)
                logs = self._train_epoch(train_loader, cbks, accumulate, limit)
                done += logs.pop("_steps")
                cbks.on_epoch_end(epoch, logs)
                record = {"epoch": epoch, **_public(logs)}
                last = epoch == epochs - 1 or (num_iters is not None and done >= num_iters)
                if eval_loader is not None and ((epoch + 1) % eval_freq == 0 or last
                                                or self.stop_training):
                    eval_logs = self._eval_loop(eval_loader, cbks)
                    record.update({f"eval_{k}": v for k, v in _public(eval_logs).items()})
                self.history.append(record)
                if self.stop_training or last:
                    break
            cbks.on_end("train", logs)
            return self.history
        finally:
            for loader, own in ((train_loader, own_train), (eval_loader, own_eval)):
                if own:
                    loader.close()

    def evaluate(self, eval_data: Any, batch_size: int = 1, log_freq: int = 10,
                 verbose: int = 1, num_workers: int = 0,
                 callbacks: Sequence[Callback] | None = None,
                 num_iters: int | None = None) -> dict[str, float]:
        """The loss (if prepared) and metrics over ``eval_data``, exactly.

        Every sample counts once: the padding rows of the last batches are dropped,
        so the result is what one device computes over the whole dataset.

        Returns:
            ``{"loss": ..., "acc": ...}`` (the metric names), as floats (lists for
            metrics with several values).
        """
        self._check_ready("evaluate", need_loss=False)
        batch_size = int_at_least("batch_size", batch_size, 1)
        log_freq = int_at_least("log_freq", log_freq, 1)
        check_verbose(verbose)
        loader, own = make_loader(eval_data, batch_size, False, False, num_workers, "eval_data")
        try:
            cbks = self._callbacks(callbacks, verbose, log_freq, {
                "batch_size": batch_size, "verbose": verbose, "log_freq": log_freq,
                "metrics": self._metrics_name(),
            })
            return _public(self._eval_loop(loader, cbks, num_iters))
        finally:
            if own:
                loader.close()

    def predict(self, test_data: Any, batch_size: int = 1, num_workers: int = 0,
                stack_outputs: bool = False, verbose: int = 1,
                callbacks: Sequence[Callback] | None = None) -> list:
        """The network's outputs for every sample, in dataset order, padding removed.

        Samples may hold labels after the inputs; they are ignored.

        Returns:
            One entry per network output: a list of per-batch arrays, or with
            ``stack_outputs=True`` one array with a row per sample.
        """
        batch_size = int_at_least("batch_size", batch_size, 1)
        check_verbose(verbose)
        loader, own = make_loader(test_data, batch_size, False, False, num_workers, "test_data")
        try:
            cbks = self._callbacks(callbacks, verbose, 1, {
                "batch_size": batch_size, "verbose": verbose, "metrics": []})
            self.network.eval()
            step = self._step("predict")
            outputs: list[list[np.ndarray]] | None = None
            cbks.on_begin("predict", {"steps": len(loader), "metrics": []})
            for i, batch in enumerate(loader):
                inputs, _ = split_batch(batch, self._num_inputs)
                cbks.on_batch_begin("predict", i, {})
                out = loader.gather_for_metrics(step(self.network, inputs))
                out = list(out) if isinstance(out, (tuple, list)) else [out]
                if outputs is None:
                    outputs = [[] for _ in out]
                for acc, o in zip(outputs, out):
                    acc.append(o)
                cbks.on_batch_end("predict", i, {"step": i, "batch_size": len(out[0])})
            cbks.on_end("predict", {})
            outputs = outputs or []
            if stack_outputs:
                return [np.concatenate(o) for o in outputs]
            return outputs
        finally:
            if own:
                loader.close()

    def _train_epoch(self, loader: Any, cbks: CallbackList, accumulate: int,
                     limit: int | None) -> dict[str, Any]:
        self.network.train()
        for m in self._metrics:
            m.reset()
        steps = len(loader)
        if limit is not None:
            steps = min(steps, limit)
        logs: dict[str, Any] = {}
        total, rows_seen, done, pending = None, 0, 0, None
        for step, batch in enumerate(loader):
            if step >= steps:
                break
            inputs, labels = split_batch(batch, self._num_inputs)
            rows = global_rows(inputs)
            cbks.on_batch_begin("train", step, logs)
            update = (step + 1) % accumulate == 0 or step + 1 == steps
            loss, metric_rows = self._train_call(inputs, labels, update)
            # The metric rows of a step go to the host once the next step is queued,
            # so the device never waits for the host (the last step's at once).
            if pending is not None:
                self._update_metrics(loader, *pending)
            pending = (step, metric_rows) if self._metrics else None
            if pending is not None and step + 1 == steps:
                self._update_metrics(loader, *pending)
                pending = None
            weighted = loss * rows
            total = weighted if total is None else total + weighted
            rows_seen += rows
            done += 1
            logs = {"loss": loss, **self._metric_logs(), "step": step, "batch_size": rows}
            cbks.on_batch_end("train", step, logs)
        if pending is not None:  # the loader ran out before len(loader) steps
            self._update_metrics(loader, *pending)
            logs.update(self._metric_logs())
        if done == 0:
            raise FleetConfigError(
                "the training data gave no batch this epoch; use a larger dataset, a smaller "
                "batch_size, or drop_last=False"
            )
        logs["loss"] = float(total) / rows_seen
        logs["_steps"] = done
        return logs

    def _eval_loop(self, loader: Any, cbks: CallbackList,
                   num_iters: int | None = None) -> dict[str, Any]:
        self.network.eval()
        for m in self._metrics:
            m.reset()
        step_fn = self._step("eval")
        steps = len(loader) if num_iters is None else min(len(loader), num_iters)
        cbks.on_begin("eval", {"steps": steps, "metrics": self._metrics_name()})
        loss_sum, count = 0.0, 0
        logs: dict[str, Any] = {}
        for step, batch in enumerate(loader):
            if step >= steps:
                break
            inputs, labels = split_batch(batch, self._num_inputs)
            cbks.on_batch_begin("eval", step, logs)
            losses, metric_rows = loader.gather_for_metrics(
                step_fn(self.network, inputs, labels))
            for m, r in zip(self._metrics, metric_rows):
                m.update(*r)
            if losses is not None:
                rows = len(losses)
            elif metric_rows:
                rows = len(metric_rows[0][0])
            else:
                rows = global_rows(inputs)
            logs = {}
            if losses is not None:
                loss_sum += float(np.sum(losses, dtype=np.float64))
                count += len(losses)
                logs["loss"] = loss_sum / count
            logs.update(self._metric_logs())
            logs.update(step=step, batch_size=rows)
            cbks.on_batch_end("eval", step, logs)
        logs = {k: v for k, v in logs.items() if k not in ("step", "batch_size")}
        cbks.on_end("eval", logs)
        self.network.train()
        return logs

    def _update_metrics(self, loader: Any, step: int, metric_rows: tuple) -> None:
        """Updates the metrics with step ``step``'s rows, padding rows dropped."""
        rows = jax.tree.map(_to_host, metric_rows)
        sampler = loader.batch_sampler
        if hasattr(sampler, "padding_mask"):
            keep = ~sampler.padding_mask(step)
            rows = jax.tree.map(lambda a: a[keep] if len(a) == len(keep) else a, rows)
        for m, r in zip(self._metrics, rows):
            m.update(*r)

    def _metric_logs(self) -> dict[str, Any]:
        logs = {}
        for m in self._metrics:
            values = m.accumulate()
            names = m.name()
            if len(names) == 1:
                logs[names[0]] = values[0] if isinstance(values, (list, tuple)) else values
            else:
                logs.update(zip(names, values))
        return logs

    def _callbacks(self, callbacks: Sequence[Callback] | None, verbose: int, log_freq: int,
                   params: dict[str, Any], save_dir: Any = None,
                   save_freq: int = 1) -> CallbackList:
        cbks = list(callbacks or [])
        for cb in cbks:
            if not isinstance(cb, Callback):
                raise FleetTypeError(
                    f"callbacks must be fleet.callbacks.Callback objects, got "
                    f"{type(cb).__name__}; subclass fleet.callbacks.Callback"
                )
        if verbose and not any(isinstance(cb, ProgBarLogger) for cb in cbks):
            cbks.insert(0, ProgBarLogger(log_freq, verbose))
        if save_dir is not None and not any(isinstance(cb, ModelCheckpoint) for cb in cbks):
            cbks.append(ModelCheckpoint(save_freq, save_dir))
        for cb in cbks:
            cb.set_model(self)
            cb.set_params(params)
        return CallbackList(cbks)

    @staticmethod
    def _resume_point(cbks: CallbackList, train_loader: Any, resume: bool) -> int:
        """Gives checkpoint callbacks the loader; with ``resume``, restores the newest
        epoch checkpoint and returns the epoch to start from."""
        checkpoints = [cb for cb in cbks.callbacks
                       if isinstance(cb, ModelCheckpoint) and cb.save_dir is not None]
        for cb in checkpoints:
            cb.loader = train_loader
        if not resume:
            return 0
        if not checkpoints:
            raise FleetConfigError(
                "fit(resume=True) continues from the checkpoints in save_dir, but no "
                "save_dir was given; pass save_dir=... (the same as the run to resume)"
            )
        return checkpoints[0].restore_latest()

    def _check_ready(self, what: str, need_optimizer: bool = False,
                     need_loss: bool = False) -> None:
        if need_optimizer and self._optimizer is None:
            raise FleetError(
                f"{what} needs an optimizer: " + _NEEDS_PREPARE.format(what=what))
        if need_loss and self._loss is None:
            raise FleetError(f"{what} needs a loss: " + _NEEDS_PREPARE.format(what=what))

    # -- saving, loading, summary -------------------------------------------------------

    def save(self, path: str | os.PathLike, training: bool = True) -> None:
        """Writes ``{path}.pdparams`` and, with ``training``, ``{path}.pdopt``.

        Every process must call it (the first one writes, the others wait).
        """
        path = os.fspath(path)
        _saving.write_arrays(path + _saving.PARAMS_SUFFIX, self.network.state_dict())
        if training and self._optimizer is not None:
            _saving.write_arrays(path + _saving.OPT_SUFFIX,
                                 _saving.optimizer_state_dict(self._optimizer))

    def load(self, path: str | os.PathLike, skip_mismatch: bool = False,
             reset_optimizer: bool = False) -> None:
        """Loads what :meth:`save` wrote (the optimizer state too, if it was saved and
        ``reset_optimizer`` is False; before ``prepare``, it is kept for it).

        With ``skip_mismatch``, saved values whose name or shape does not fit the
        network are skipped (with a warning); otherwise they are an error.
        """
        path = os.fspath(path)
        params = _saving.read_arrays(path + _saving.PARAMS_SUFFIX, "parameter")
        if skip_mismatch:
            params, skipped = _saving.fit_params(self.network, params)
            if skipped:
                warnings.warn(f"Model.load skipped {len(skipped)} saved values that do not "
                              f"fit the network: {', '.join(skipped)}", FleetWarning,
                              stacklevel=2)
        self.network.set_state_dict(params)
        opt_path = path + _saving.OPT_SUFFIX
        if reset_optimizer or not os.path.exists(opt_path):
            return
        state = _saving.read_arrays(opt_path, "optimizer")
        if self._optimizer is None:
            self._pending_opt_state = state
        else:
            _saving.set_optimizer_state_dict(self._optimizer, state)

    def parameters(self) -> dict[str, np.ndarray]:
        """The network's parameters by name, as host arrays."""
        return self.network.state_dict()

    def summary(self, input_size: Any = None, dtype: Any = None) -> dict[str, int]:
        """Prints the layers and their parameter counts (and, given ``input_size``
        including the batch axis, e.g. ``(1, 784)``, the output shape).

        Returns:
            ``{"total_params": ..., "trainable_params": ...}``.
        """
        if input_size is None and self._inputs is not None and not isinstance(self._inputs, int):
            input_size = [tuple(1 if d is None else d for d in s.shape) for s in self._inputs]
            dtype = [s.dtype for s in self._inputs]
        return _summary(self.network, input_size, dtype)


# -- helpers ------------------------------------------------------------------------------


def _public(logs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in logs.items():
        if k in ("step", "batch_size") or k.startswith("_"):
            continue
        out[k] = [float(x) for x in v] if isinstance(v, (list, tuple)) else float(v)
    return out
