"""fleet.hapi: the high-level API, Paddle's ``paddle.Model`` for a JAX mesh.

::

    import optax
    from fleet.hapi import Model, metric

    model = Model(network)                      # a Flax NNX module
    model.prepare(optax.adam(1e-3), optax.softmax_cross_entropy_with_integer_labels,
                  metric.Accuracy())
    model.fit(train_dataset, test_dataset, epochs=5, batch_size=64)

The same script runs on one process (every local device) and under
``fleetrun --nproc_per_node N`` with no change. For that, importing this package
in a worker started by a launcher (``FLEET_WORLD_SIZE`` > 1) joins the job's
distributed runtime (``jax.distributed.initialize``) at once: JAX allows that only
before its first computation, and a script builds its network, which computes,
before it creates the :class:`Model`.

Files: ``_model.py`` (Model), ``_steps.py`` (the per-replica steps),
``_inputs.py`` (datasets, loaders, batches, argument checks), ``_metric.py``
(metrics), ``_callbacks.py`` (callbacks), ``_progbar.py`` (progress bar),
``_saving.py`` (save / load), ``_summary.py`` (summary).
"""

from fleet.hapi import callbacks, metric
from fleet.hapi._callbacks import Callback
from fleet.hapi._metric import Accuracy, Metric
from fleet.hapi._model import Model
from fleet.hapi._progbar import ProgressBar


def _join_launched_job() -> None:
    """Initialises ``jax.distributed`` now when a launcher started this process."""
    import jax

    from fleet import _world
    from fleet._env import WorkerEnv

    try:
        env = WorkerEnv.from_environ()
    except Exception:  # a malformed environment: fleet.init reports it properly
        return
    if not env.is_multiprocess or jax.distributed.is_initialized():
        return
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            return  # too late: fleet.init will say what to do
    except (ImportError, AttributeError):
        return
    _world._initialize_distributed(env)


_join_launched_job()

__all__ = ["Accuracy", "Callback", "Metric", "Model", "ProgressBar", "callbacks", "metric"]
