"""fleet.hapi: the high-level API, Paddle's ``paddle.Model`` for a JAX mesh.

::

    import fleet
    import optax

    model = fleet.Model(network)                # a Flax NNX module
    model.prepare(optax.adam(1e-3), optax.softmax_cross_entropy_with_integer_labels,
                  fleet.metric.Accuracy())
    model.fit(train_dataset, test_dataset, epochs=5, batch_size=64)

The same script runs on one process (every local device) and under
``fleetrun --nproc_per_node N`` with no change: ``import fleet`` in a worker
started by a launcher joins the job's distributed runtime at once (see
``fleet.runtime._world.join_launched_job``).

Files: ``_model.py`` (Model), ``_steps.py`` (the per-replica steps),
``_loops.py`` (an epoch's loop), ``_inputs.py`` (datasets, loaders, batches,
argument checks), ``_metric.py`` (metrics), ``_callbacks.py`` (callbacks),
``_progbar.py`` (progress bar), ``_config.py`` (a run's callbacks, assembled),
``_saving.py`` (save / load), ``_export.py`` (the inference model:
``save(path, training=False)``, ``load_inference``), ``_export_check.py`` (its
checks: the program's checksum, the weights' fit), ``_summary.py`` (summary).

It builds on the whole package below it (the core, ``io``, ``checkpoint``);
nothing below imports it.
"""

from fleet.hapi import callbacks, metric
from fleet.hapi._callbacks import Callback
from fleet.hapi._export import load_inference
from fleet.hapi._metric import Accuracy, Metric
from fleet.hapi._model import Model
from fleet.hapi._progbar import ProgressBar

__all__ = ["Accuracy", "Callback", "Metric", "Model", "ProgressBar", "callbacks", "load_inference",
           "metric"]
