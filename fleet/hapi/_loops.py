"""The one loop of :class:`fleet.Model`: a pass over a loader in a mode.

``fit`` runs :func:`run_epoch` in ``"train"`` mode once per epoch (and in
``"eval"`` mode at the evaluation epochs), ``evaluate`` once in ``"eval"`` mode,
``predict`` once in ``"predict"`` mode. The skeleton is the same for the three:
split each batch into inputs and labels, call the callbacks around the step, run
the step, and bring its per-example rows to the host with the loader's
``gather_for_metrics`` (which drops the rows the sampler repeated as padding), so
metrics, evaluation losses and predictions count every sample exactly once.

With metrics, training brings each step's metric rows to the host right after
the step, as Paddle does, so the metric a step's logs show is the one after that
step (a wait for the devices per step; a model without metrics never waits). A
training step's logs hold the loss, and with float16 amp the loss scale and the
count of skipped steps (:func:`amp_logs`), as device arrays: they are read, a
wait for the devices, only where they are printed or kept (the progress bar every
``log_freq`` steps, the epoch's record), not every step.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from fleet._errors import FleetConfigError
from fleet.hapi._inputs import global_rows, split_batch


def run_epoch(model: Any, loader: Any, mode: str, cbks: Any, num_iters: int | None = None,
              accumulate: int = 1) -> tuple[dict[str, Any], list[list[np.ndarray]]]:
    """One pass of ``model`` over ``loader`` in ``mode``, at most ``num_iters`` steps.

    Returns the logs (``loss``, the metrics by name, ``_steps``) and, in
    ``"predict"`` mode, the outputs: one list of per-batch host arrays per output.
    """
    network, metrics = model.network, model.metrics if mode != "predict" else []
    network.train() if mode == "train" else network.eval()
    for m in metrics:
        m.reset()
    steps = len(loader) if num_iters is None else min(len(loader), num_iters)
    if mode != "train":
        cbks.on_begin(mode, {"steps": steps, "metrics": [n for m in metrics for n in m.name()]})
    loss_sum, count, done = 0.0, 0, 0
    logs: dict[str, Any] = {}
    outputs: list[list[np.ndarray]] = []
    for step, batch in enumerate(loader):
        if step >= steps:
            break
        inputs, labels = split_batch(batch, model.num_inputs)
        cbks.on_batch_begin(mode, step, logs)
        logs = {}
        if mode == "train":
            update = (step + 1) % accumulate == 0 or step + 1 == steps
            group = min(accumulate, steps - step // accumulate * accumulate)
            loss, rows = model.train_step(inputs, labels, update, 1.0 / group)
            if metrics:  # the metric printed at a step is the one after it, as in Paddle
                update_metrics(metrics, loader.gather_for_metrics(rows, step=step))
            n = global_rows(inputs)
            loss_sum, count = loss_sum + loss * n, count + n  # stays on the device
            logs["loss"] = loss
            logs.update(amp_logs(model.optimizer))
        elif mode == "eval":
            losses, rows = loader.gather_for_metrics(model.eval_step(inputs, labels))
            update_metrics(metrics, rows)
            n = len(losses) if losses is not None else (
                len(rows[0][0]) if rows else global_rows(inputs))
            if losses is not None:
                loss_sum += float(np.sum(losses, dtype=np.float64))
                count += n
                logs["loss"] = loss_sum / count
        else:
            out = loader.gather_for_metrics(model.predict_step(inputs))
            out = list(out) if isinstance(out, (tuple, list)) else [out]
            outputs = outputs or [[] for _ in out]
            for acc, o in zip(outputs, out):
                acc.append(o)
            n = len(out[0])
        done += 1
        logs.update(metric_logs(metrics), step=step, batch_size=n)
        cbks.on_batch_end(mode, step, logs)
    return _end_epoch(mode, cbks, logs, loss_sum, count, done), outputs


def _end_epoch(mode: str, cbks: Any, logs: dict[str, Any], loss_sum: Any, count: int,
               done: int) -> dict[str, Any]:
    """:func:`run_epoch`'s logs at the end of its pass: the last step's, less its
    ``step`` and ``batch_size``; in ``"train"`` mode with the mean loss over the
    epoch's examples and the steps ``done`` (none is an error), otherwise handed
    to the callbacks' ``on_end``."""
    logs = {k: v for k, v in logs.items() if k not in ("step", "batch_size")}
    if mode == "train":
        if done == 0:
            raise FleetConfigError(
                "the training data gave no batch this epoch; use a larger dataset, a smaller "
                "batch_size, or drop_last=False"
            )
        logs["loss"] = float(loss_sum) / count
        logs["_steps"] = done
    else:
        cbks.on_end(mode, logs)
    return logs


AMP_LOGS = ("loss_scaling", "skipped_steps")


def amp_logs(optimizer: Any) -> dict[str, Any]:
    """float16 amp's ``loss_scaling`` and ``skipped_steps`` (the distributed
    optimizer's state after the step, as device arrays), or ``{}`` when the
    optimizer does not scale the loss. Copies, made on the device: the next
    step donates the optimizer's own arrays (fleet/step/_donate.py)."""
    if getattr(optimizer, "amp_rules", None) is None:
        return {}
    return {name: jnp.copy(getattr(optimizer, name)[...]) for name in AMP_LOGS}


def update_metrics(metrics: list, rows: tuple) -> list:
    """Each metric's ``update`` with its host rows; what they return (the batch's values)."""
    return [m.update(*r) for m, r in zip(metrics, rows)]


def metric_logs(metrics: list) -> dict[str, Any]:
    """The metrics' accumulated values by name."""
    logs = {}
    for m in metrics:
        values, names = m.accumulate(), m.name()
        if len(names) == 1:
            logs[names[0]] = values[0] if isinstance(values, (list, tuple)) else values
        else:
            logs.update(zip(names, values))
    return logs


def public(logs: dict[str, Any]) -> dict[str, Any]:
    """The logs a caller gets: floats (ints for integer values, such as
    ``skipped_steps``; lists for several values), no bookkeeping keys."""
    out = {}
    for k, v in logs.items():
        if k in ("step", "batch_size") or k.startswith("_"):
            continue
        out[k] = [_number(x) for x in v] if isinstance(v, (list, tuple)) else _number(v)
    return out


def _number(value: Any) -> float | int:
    value = np.asarray(value)
    return int(value) if np.issubdtype(value.dtype, np.integer) else float(value)


def train_epochs(model: Any, cbks: Any, train_loader: Any, eval_loader: Any, epochs: range,
                 eval_freq: int, num_iters: int | None, accumulate: int) -> list[dict[str, Any]]:
    """``Model.fit``'s epochs, between the callbacks' ``on_begin`` and ``on_end``:
    each trained, then evaluated every ``eval_freq`` epochs from the first
    (Paddle's ``epoch % eval_freq == 0``), its record added to ``model.history``
    (emptied first); returns ``model.history``."""
    model.stop_training, model.history = False, []
    cbks.on_begin("train")
    logs: dict[str, Any] = {}
    done = 0
    for epoch in epochs:
        cbks.on_epoch_begin(epoch)
        limit = None if num_iters is None else num_iters - done
        logs, _ = run_epoch(model, train_loader, "train", cbks, limit, accumulate)
        done += logs.pop("_steps")
        cbks.on_epoch_end(epoch, logs)
        record = {"epoch": epoch, **public(logs)}
        if eval_loader is not None and epoch % eval_freq == 0:
            eval_logs, _ = run_epoch(model, eval_loader, "eval", cbks)
            record.update({f"eval_{k}": v for k, v in public(eval_logs).items()})
        model.history.append(record)
        if model.stop_training or (num_iters is not None and done >= num_iters):
            break
    cbks.on_end("train", logs)
    return model.history
