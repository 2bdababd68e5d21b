"""fleet.io: datasets, batch samplers and a DataLoader that feeds sharded batches.

Paddle's ``paddle.io`` for a JAX mesh::

    import fleet
    from fleet.io import DataLoader, DistributedBatchSampler

    fleet.init(is_collective=True)
    sampler = DistributedBatchSampler(train_dataset, 32, shuffle=True, drop_last=True)
    loader = DataLoader(train_dataset, batch_sampler=sampler, num_workers=2)
    for epoch in range(epochs):
        for images, labels in loader:          # global jax.Arrays, sharded over "data"
            state, loss = train_step(state, images, labels)

``batch_size`` is per replica, and a replica is a device. Every batch array is a
global ``jax.Array`` with ``fleet.world().batch`` sharding; each device holds its
own replica's rows. For exact evaluation, pass per-example outputs through
``loader.gather_for_metrics`` to drop the samples the sampler repeated as padding.
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
