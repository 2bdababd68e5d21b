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

What the folder holds, one idea per file:

* ``_order.py``: the pure order, which dataset indices make up each batch of an
  epoch (Paddle's split, padding, shuffle) -- functions, no state;
* ``_sampler.py``: ``BatchSampler`` and ``DistributedBatchSampler``, the order plus
  an epoch counter and a restored start; ``_sampler_args.py``: their arguments
  checked against the data and the world (replica defaults from ``fleet.init``,
  one dataset length on every process);
* ``_position.py``: where iteration stands, held once, by the iterator that hands
  the batches out, and read (never held) by ``state_dict()``;
* ``_loader.py``: ``DataLoader``; ``_pipeline.py``: loading ahead and the
  loader's iterator; ``_placement.py``: host batches to global arrays and back;
* ``_workers.py`` and ``_shm.py``: worker processes and the shared memory their
  batches come back through; ``_collate.py``: samples to a batch;
* ``_dataset.py``: ``Dataset``, ``TensorDataset``; ``_errors.py``: io's errors.

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
