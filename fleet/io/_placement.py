"""Between the host and the mesh: process-local batches in, global arrays out, and back.

:class:`GlobalTransfer` places a host (numpy) batch on this process's devices as
global ``jax.Array``s sharded over the ``data`` axis (``fleet.world().batch``);
:func:`gather_to_host` brings per-example outputs back, every process's rows;
:func:`check_sampler_fits_world` refuses a sampler whose split would not give each
process its own share of those global arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from fleet._errors import FleetConfigError
from fleet.io._errors import FleetDataError
from fleet.io._sampler import BatchSampler, DistributedBatchSampler
from fleet.runtime._world import World, first_local_replica
from fleet.step._global_arrays import to_global


class GlobalTransfer:
    """Places a process-local numpy batch on the mesh as global arrays.

    All numeric leaves go in one batched transfer (``fleet.step._global_arrays.to_global``);
    strings and other non-numeric leaves stay on the host.
    """

    def __init__(self, sharding, num_local: int, first_step: int):
        self.sharding, self.num_local, self.step = sharding, num_local, first_step

    def __call__(self, batch: Any) -> Any:
        step = self.step
        self.step += 1
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        numeric = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, (str, bytes)) or not hasattr(leaf, "__array__"):
                continue
            leaf = np.asarray(leaf)
            if leaf.dtype.kind not in "biufc":
                continue
            if leaf.ndim == 0 or leaf.shape[0] % self.num_local:
                raise FleetDataError(
                    f"batch {step} has an array of shape {leaf.shape}, whose leading axis "
                    f"does not split over this process's {self.num_local} devices; use a "
                    "DistributedBatchSampler (batch_size is then per device), or "
                    "drop_last=True, or return_numpy=True"
                )
            leaves[i] = leaf
            numeric.append(i)
        if not numeric:
            return batch
        placed = to_global([leaves[i] for i in numeric], self.sharding)
        for i, array in zip(numeric, placed):
            leaves[i] = array
        return jax.tree_util.tree_unflatten(treedef, leaves)


def gather_to_host(x: Any) -> np.ndarray:
    """``x`` as a numpy array with every process's rows (a global array is gathered;
    a process-local value is gathered from every process). Not
    ``fleet.runtime._leaves.to_host``, which takes one replica's copy of a replicated value."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    if not isinstance(x, jax.Array) and jax.process_count() > 1:
        return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))
    return np.asarray(x)


def check_sampler_fits_world(sampler: Any, world: World) -> None:
    """A sampler feeding global arrays must give each process its own, disjoint share."""
    if isinstance(sampler, DistributedBatchSampler):
        per_device = (sampler.num_replicas == world.num_replicas
                      and sampler.num_local_replicas == world.num_local_replicas
                      and sampler.rank == first_local_replica(world))
        per_process = (sampler.num_replicas == jax.process_count()
                       and sampler.num_local_replicas == 1
                       and sampler.rank == jax.process_index())
        if not (per_device or per_process):
            raise FleetConfigError(
                f"the DistributedBatchSampler covers replicas [{sampler.rank}, "
                f"{sampler.rank + sampler.num_local_replicas}) of {sampler.num_replicas}, "
                f"but this process feeds devices [{first_local_replica(world)}, "
                f"{first_local_replica(world) + world.num_local_replicas}) of "
                f"{world.num_replicas}; build the sampler after fleet.init with "
                "num_replicas=None and rank=None, or use return_numpy=True"
            )
    elif isinstance(sampler, BatchSampler) and jax.process_count() > 1:
        raise FleetConfigError(
            f"a plain BatchSampler gives every one of the {jax.process_count()} processes "
            "the same batches, so the global batch would repeat them; use "
            "DistributedBatchSampler"
        )
