"""fleet.io: datasets, batch samplers and a DataLoader that feeds sharded batches.

Paddle's ``paddle.io`` for a JAX mesh::

    import fleet

    fleet.init(is_collective=True)
    sampler = fleet.io.DistributedBatchSampler(train_dataset, 32, shuffle=True, drop_last=True)
    loader = fleet.io.DataLoader(train_dataset, batch_sampler=sampler, num_workers=2)
    for epoch in range(epochs):
        for images, labels in loader:          # global jax.Arrays, sharded over "data"
            state, loss = train_step(state, images, labels)

``batch_size`` is per replica, and a replica is a device. Every batch array is a
global ``jax.Array`` with ``fleet.world().batch`` sharding; each device holds its
own replica's rows. For exact evaluation, pass per-example outputs through
``loader.gather_for_metrics`` to drop the samples the sampler repeated as padding.

The path of one batch through the folder's files: docs/architecture.md ("One
batch, from the sampler to the devices"). Besides those: ``_sampler_args.py``
(the samplers' arguments checked against the data and the world),
``_position.py`` (where iteration stands, held once, by the iterator),
``_dataset.py``, ``_errors.py``, ``_main_guard.py``.

What it may import: numpy, jax, the standard library, its own modules, and from
the core only its public-in-package names: ``fleet._errors`` (the errors),
``fleet.runtime._world`` (``world``, ``is_initialized``, ``first_local_replica``, ``World``),
``fleet.runtime._agree`` (``agree``, ``raise_together``) and ``fleet.step._global_arrays.to_global``
(the one path from a process's rows to a global array). Never an
underscore name of a core module, never ``fleet.hapi`` or ``fleet.checkpoint``
(they import io), and no import inside a function.
"""

from fleet.io._collate import default_collate_fn
from fleet.io._dataset import Dataset, TensorDataset
from fleet.io._errors import FleetDataError, FleetWorkerError
from fleet.io._loader import DataLoader
from fleet.io._sampler import BatchSampler, DistributedBatchSampler
from fleet.io._workers import WorkerInfo, get_worker_info

__all__ = [
    "BatchSampler",
    "DataLoader",
    "Dataset",
    "DistributedBatchSampler",
    "FleetDataError",
    "FleetWorkerError",
    "TensorDataset",
    "WorkerInfo",
    "default_collate_fn",
    "get_worker_info",
]
