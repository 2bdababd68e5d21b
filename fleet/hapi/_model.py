"""``fleet.Model``: Paddle's high-level ``paddle.Model`` on a data-parallel mesh.

The script is the single-device one (``fleet.Model`` calls ``fleet.init`` itself);
``python train.py`` trains on every local device, ``fleetrun --nproc_per_node 2
train.py`` on every device of both processes. Underneath is the four-step API:
``fleet.distributed_model`` / ``distributed_optimizer``, and the steps of
``_steps.py`` through ``fleet.distributed_step``; the loops are in ``_loops.py``.
A dataset gets a ``DistributedBatchSampler`` (``batch_size`` per device), so each
global batch is the one a single device would take with ``batch_size x replicas``
rows, and the trained parameters are the single device's. Evaluation and
prediction drop the sampler's padding: metrics are exact, predictions come back
once each, in dataset order.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fleet._errors import FleetWarning
from fleet.hapi import _export, _saving, _steps
from fleet.hapi._callbacks import Callback
from fleet.hapi._config import config_callbacks
from fleet.hapi._inputs import (
    as_tuple,
    check_network,
    check_prepare,
    check_ready,
    count_inputs,
    loader_for,
    loop_counts,
)
from fleet.hapi._loops import public, run_epoch, train_epochs, update_metrics
from fleet.hapi._metric import Metric
from fleet.hapi._summary import summary as _summary
from fleet.io._placement import gather_to_host
from fleet.runtime import _world
from fleet.wrappers._data_parallel import DataParallel, distributed_model


class Model:
    """A network with its training loop: ``prepare``, ``fit``, ``evaluate``, ``predict``.

    Args:
        network: a Flax NNX module (or a ``fleet.DataParallel`` of one). It is
            wrapped with ``fleet.distributed_model``: its variables are replicated
            on the mesh and updated in place by training.
        inputs: how many leading fields of each sample are the network's inputs
            (an int, or a list with one ``fleet.static.InputSpec`` per input, as
            Paddle's ``InputSpec`` list, or ``jax.ShapeDtypeStruct``); the
            remaining fields are the labels.
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
        check_network(network)
        if not _world.is_initialized():
            _world.init(is_collective=True)
        self.network = network if isinstance(network, DataParallel) else distributed_model(network)
        self.num_inputs = count_inputs(network, inputs)  # the leading fields of a sample
        self._inputs = inputs
        self._seen: tuple = ()  # the last batch's inputs (their shapes, for an export)
        self.optimizer: Any = None  # set by prepare: the distributed nnx.Optimizer
        self.loss: Any = None
        self.metrics: list[Metric] = []
        self._predict = _steps.make_predict_step()  # prepare adds the train and eval steps
        self._pending_opt_state: dict | None = None
        self.stop_training = False
        self.history: list[dict[str, Any]] = []

    def prepare(self, optimizer: Any = None, loss: Any = None,
                metrics: Metric | Sequence[Metric] | None = None) -> None:
        """Sets the optimizer, the loss and the metrics.

        Args:
            optimizer: an optax transformation (``optax.adam(1e-3)``; applied to the
                network's ``nnx.Param`` variables) or an ``nnx.Optimizer`` built on
                the network; either becomes a ``fleet.DistributedOptimizer`` (which
                holds float16 amp's loss scale). ``None`` is enough for ``evaluate``
                / ``predict``.
            loss: ``loss(outputs, *labels)`` returning one value per example (as
                optax's losses do) or their mean. ``fit`` minimises its mean.
            metrics: a :class:`fleet.metric.Metric` or a list of them.
        """
        optimizer, loss, metrics = check_prepare(self.network, optimizer, loss, metrics)
        self.optimizer, self.loss, self.metrics = optimizer, loss, metrics
        self._train = _steps.make_train_step(loss, metrics)
        self._eval = _steps.make_eval_step(loss, metrics)
        if self._pending_opt_state is not None and optimizer is not None:
            _saving.set_optimizer_state_dict(optimizer, self._pending_opt_state)
            self._pending_opt_state = None

    def metrics_name(self) -> list[str]:
        """The metrics' names, in order (Paddle's ``_metrics_name``)."""
        return [n for m in self.metrics for n in m.name()]

    def train_step(self, inputs: tuple, labels: tuple, update: bool = True,
                   scale: float = 1.0) -> tuple[jax.Array, tuple]:
        """One training step: ``(loss, metric rows)``, on the devices. The gradient is
        that of ``scale * loss``; ``update=False`` accumulates it (``no_sync``: the
        gradients add up until the next update)."""
        self._seen = inputs
        if update:
            return self._train(self.network, self.optimizer, inputs, labels, scale)
        with self.network.no_sync():
            return self._train(self.network, self.optimizer, inputs, labels, scale)

    def eval_step(self, inputs: tuple, labels: tuple) -> tuple[Any, tuple]:
        """``(per-example losses or None, metric rows)`` of one batch."""
        self._seen = inputs
        return self._eval(self.network, inputs, labels)

    def predict_step(self, inputs: tuple) -> Any:
        """The network's outputs for one batch (per example)."""
        self._seen = inputs
        return self._predict(self.network, inputs)

    # -- one step (what the loops call), one batch (Paddle's *_batch) ---------------------

    def train_batch(self, inputs: Any, labels: Any = None, update: bool = True) -> Any:
        """One training step on a global batch; returns ``[loss]``, or ``([loss],
        metric values)`` with metrics. ``update=False`` accumulates the gradients
        (``no_sync``: they add up, as in Paddle); the next step with ``update=True``
        applies their sum."""
        check_ready(self, "train_batch", need_optimizer=True)
        self.network.train()
        loss, rows = self.train_step(as_tuple(inputs), as_tuple(labels), update)
        values = update_metrics(self.metrics, jax.tree.map(gather_to_host, rows))
        return ([float(loss)], values) if self.metrics else [float(loss)]

    def eval_batch(self, inputs: Any, labels: Any = None) -> Any:
        """Loss and metric values of one global batch (no padding is assumed)."""
        self.network.eval()
        losses, rows = self.eval_step(as_tuple(inputs), as_tuple(labels))
        values = update_metrics(self.metrics, jax.tree.map(gather_to_host, rows))
        loss = [float(np.mean(gather_to_host(losses)))] if losses is not None else []
        return (loss, values) if self.metrics else loss

    def predict_batch(self, inputs: Any) -> list[np.ndarray]:
        """The network's outputs for one global batch, as host arrays."""
        self.network.eval()
        out = jax.tree.map(gather_to_host, self.predict_step(as_tuple(inputs)))
        return list(out) if isinstance(out, (tuple, list)) else [out]

    # -- loops --------------------------------------------------------------------------

    def fit(self, train_data: Any = None, eval_data: Any = None, batch_size: int = 1,
            epochs: int = 1, eval_freq: int = 1, log_freq: int = 10,
            save_dir: str | os.PathLike | None = None, save_freq: int = 1, verbose: int = 1,
            drop_last: bool = False, shuffle: bool = True, num_workers: int = 0,
            callbacks: Sequence[Callback] | None = None, accumulate_grad_batches: int = 1,
            num_iters: int | None = None, resume: bool = False) -> list[dict[str, Any]]:
        """Trains for ``epochs`` epochs, evaluating every ``eval_freq`` epochs.

        Args:
            train_data: a dataset (``__len__``, ``__getitem__``; it gets a
                ``DistributedBatchSampler``) or a ``fleet.io.DataLoader`` (used as it is).
            eval_data: the same, evaluated after epochs ``0, eval_freq,
                2 * eval_freq, ...`` (Paddle's ``epoch % eval_freq == 0``).
            batch_size: samples per device per step (the global batch is
                ``batch_size * fleet.num_replicas()``).
            epochs: passes over ``train_data``.
            eval_freq: evaluate every ``eval_freq`` epochs, from the first.
            log_freq: print progress every ``log_freq`` steps.
            save_dir: save the model there every ``save_freq`` epochs and at the end.
            save_freq: see ``save_dir``.
            verbose: 0 silent, 1 progress bar, 2 one line per ``log_freq`` steps.
            drop_last: drop the last, smaller batch of each epoch.
            shuffle: reshuffle the training data every epoch.
            num_workers: loader worker processes (0: load in this process).
            callbacks: :class:`fleet.callbacks.Callback` objects.
            accumulate_grad_batches: update every ``k`` steps with the gradients of
                all ``k`` (their mean, each loss scaled by ``1 / k`` as ``no_sync`` adds
                them: one step on the union of the batches).
            num_iters: stop after this many steps (overrides ``epochs``).
            resume: continue from the newest epoch checkpoint in ``save_dir``
                (network, optimizer, loader position), if there is one: a job
                restarted by ``fleetrun --max_restarts`` goes on where it stopped.

        Returns:
            One dict per epoch: ``epoch``, the training ``loss`` (mean over the
            epoch's examples) and metrics, with float16 amp ``loss_scaling`` and
            ``skipped_steps`` at the epoch's end, and ``eval_*`` values when evaluated.
        """
        check_ready(self, "fit", need_optimizer=True, need_loss=True)
        batch_size, epochs, eval_freq, log_freq, accumulate, num_iters = loop_counts(
            verbose, batch_size=batch_size, epochs=epochs, eval_freq=eval_freq,
            log_freq=log_freq, accumulate_grad_batches=accumulate_grad_batches,
            num_iters=num_iters)
        with (loader_for(train_data, batch_size, shuffle, drop_last, num_workers,
                         "train_data") as train_loader,
              loader_for(eval_data, batch_size, False, False, num_workers, "eval_data",
                         optional=True) as eval_loader):
            steps = len(train_loader)
            if num_iters is not None:
                epochs = math.ceil(num_iters / steps)
            cbks, checkpoint = config_callbacks(self, callbacks, {
                "epochs": epochs, "steps": steps, "batch_size": batch_size, "verbose": verbose,
                "metrics": self.metrics_name(), "log_freq": log_freq, "save_freq": save_freq,
                "save_dir": None if save_dir is None else os.fspath(save_dir)},
                train_loader, resume)
            start = checkpoint.restore_latest() if resume else 0
            return train_epochs(self, cbks, train_loader, eval_loader, range(start, epochs),
                                eval_freq, num_iters, accumulate)

    def evaluate(self, eval_data: Any, batch_size: int = 1, log_freq: int = 10,
                 verbose: int = 1, num_workers: int = 0,
                 callbacks: Sequence[Callback] | None = None,
                 num_iters: int | None = None) -> dict[str, float]:
        """The loss (if prepared) and metrics over ``eval_data``, exactly.

        Every sample counts once: the padding rows of the last batches are dropped,
        so the result is what one device computes over the whole dataset.

        Returns:
            ``{"loss": [mean], "acc": ...}`` in Paddle's shape: the loss as a
            one-element list, the metrics by name as floats (lists for metrics with
            several values). The loss is the mean over all samples (Paddle's is
            the last batch's loss).
        """
        logs = public(self._run("eval", eval_data, batch_size, num_workers, verbose, log_freq,
                                callbacks, num_iters)[0])
        if "loss" in logs:
            logs["loss"] = [logs["loss"]]
        return logs

    def predict(self, test_data: Any, batch_size: int = 1, num_workers: int = 0,
                stack_outputs: bool = False, verbose: int = 1,
                callbacks: Sequence[Callback] | None = None) -> list:
        """The network's outputs for every sample, in dataset order, padding removed.

        Samples may hold labels after the inputs; they are ignored.

        Returns:
            One entry per network output: a list of per-batch arrays, or with
            ``stack_outputs=True`` one array with a row per sample.
        """
        outputs = self._run("predict", test_data, batch_size, num_workers, verbose, 1,
                            callbacks, None)[1]
        return [np.concatenate(o) for o in outputs] if stack_outputs else outputs

    def _run(self, mode: str, data: Any, batch_size: int, num_workers: int, verbose: int,
             log_freq: int, callbacks: Any, num_iters: int | None) -> tuple[dict, list]:
        batch_size, log_freq = loop_counts(verbose, batch_size=batch_size, log_freq=log_freq)
        what = "eval_data" if mode == "eval" else "test_data"
        with loader_for(data, batch_size, False, False, num_workers, what) as loader:
            cbks, _ = config_callbacks(self, callbacks, {
                "batch_size": batch_size, "verbose": verbose, "log_freq": log_freq,
                "metrics": self.metrics_name() if mode == "eval" else []})
            return run_epoch(self, loader, mode, cbks, num_iters)

    # -- saving, loading, summary -------------------------------------------------------

    def save(self, path: str | os.PathLike, training: bool = True) -> None:
        """``training=True``: writes ``{path}.pdparams`` (the network's variables) and
        ``{path}.pdopt`` (the optimizer's state), one file each, for :meth:`load`.

        ``training=False``: writes the inference model, ``{path}.jaxexport`` (the forward
        pass in evaluation mode, serialized by ``jax.export`` for CPU and CUDA, any batch
        size) and ``{path}.pdiparams`` (its weights, and the program's size and CRC-32,
        checked before it is read), for :func:`fleet.load_inference`, which runs it
        without the model's class, on ``fleet.Model(inputs=...)``'s or the last shapes.

        Every process must call it (the first one writes, the others wait).
        """
        path = os.fspath(path)
        if not training:
            return _export.export(self.network, _export.input_specs(self._inputs, self._seen),
                                  path)
        _saving.write_arrays(path + _saving.PARAMS_SUFFIX, self.network.state_dict())
        if self.optimizer is not None:
            _saving.write_arrays(path + _saving.OPT_SUFFIX,
                                 _saving.optimizer_state_dict(self.optimizer))

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
        if self.optimizer is None:
            self._pending_opt_state = state
        else:
            _saving.set_optimizer_state_dict(self.optimizer, state)

    def parameters(self) -> dict[str, np.ndarray]:
        """The network's parameters by name, as host arrays."""
        return self.network.state_dict()

    def summary(self, input_size: Any = None, dtype: Any = None) -> dict[str, int]:
        """Prints Paddle's table: each layer call's shapes and parameters (given
        ``input_size`` with the batch axis, e.g. ``(1, 784)``, or ``inputs=``).

        Returns:
            ``{"total_params": ..., "trainable_params": ...}``.
        """
        return _summary(self.network, input_size, dtype, inputs=self._inputs)
