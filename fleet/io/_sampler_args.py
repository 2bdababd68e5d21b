"""A sampler's arguments checked against the data and the world.

Counts (ints with a lower bound; the loader's too), the dataset's size, which
replicas this process covers (the defaults come from ``fleet.init``), and the
check, when a distributed sampler starts, that every process split a dataset of
the same length.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from fleet._errors import FleetConfigError, FleetTypeError
from fleet.runtime._agree import agree, raise_together
from fleet.runtime._world import first_local_replica, is_initialized, world

LENGTH_AGREEMENT = "fleet.io.DistributedBatchSampler.dataset_length"


def int_at_least(name: str, value: Any, low: int = 1) -> int:
    """``value`` as an int, refused (naming ``name``) unless it is an int ``>= low``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise FleetTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise FleetConfigError(f"{name}={value} must be at least {low}")
    return int(value)


def dataset_size(dataset: Any) -> int:
    """``len(dataset)``, with an error that says what a sampler needs."""
    try:
        return len(dataset)
    except TypeError:
        raise FleetTypeError(
            f"{type(dataset).__name__} has no len(); a sampler needs a map-style dataset "
            "(define __len__ and __getitem__) or a sized sampler"
        ) from None
    except (ValueError, OverflowError):  # __len__ returned a negative (or huge) number
        raise FleetConfigError(
            f"len() of the {type(dataset).__name__} is {type(dataset).__len__(dataset)!r}; "
            "__len__ must return the number of samples, an int >= 0"
        ) from None


def resolve_replicas(
    num_replicas: int | None, rank: int | None, num_local_replicas: int | None
) -> tuple[int, int, int]:
    """``(num_replicas, rank, num_local_replicas)``, the ``None`` ones from the world.

    After ``fleet.init`` the defaults are every device of every process and this
    process's devices; an explicit ``rank`` (one replica per process, Paddle's
    style) means one local replica. Without ``fleet.init``: one replica, rank 0.
    """
    here = world() if is_initialized() else None
    if num_replicas is None:
        num_replicas = here.num_replicas if here is not None else 1
    num_replicas = int_at_least("num_replicas", num_replicas)
    per_device = here is not None and rank is None and num_replicas == here.num_replicas
    if num_local_replicas is None:
        num_local_replicas = here.num_local_replicas if per_device else 1
    num_local_replicas = int_at_least("num_local_replicas", num_local_replicas)
    if rank is None:
        if per_device:
            rank = first_local_replica(here)
        elif here is not None:
            rank = jax.process_index() * num_local_replicas
        else:
            rank = 0
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool):
        raise FleetTypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
    if not 0 <= rank or rank + num_local_replicas > num_replicas:
        raise FleetConfigError(
            f"rank={rank} with num_local_replicas={num_local_replicas} covers replicas "
            f"[{rank}, {rank + num_local_replicas}), outside the {num_replicas} replicas "
            f"(allowed ranks: 0..{num_replicas - num_local_replicas}); leave rank and "
            "num_replicas as None to take them from fleet.init"
        )
    return num_replicas, int(rank), num_local_replicas


def agree_on_length(size: int, num_replicas: int, num_local_replicas: int) -> None:
    """Every process must split the same index list; a dataset of another length on
    one process would give it another number of batches, and the job would hang in
    the step after the shorter process's last batch. Collective when several
    processes share the replicas; raises on every process if the lengths differ."""
    if not is_initialized() or num_local_replicas == num_replicas:
        return  # this process feeds every replica: nobody to agree with
    if jax.process_count() == 1:
        return
    lengths = [int(v) for v in agree(LENGTH_AGREEMENT, str(size))]
    if len(set(lengths)) > 1:
        raise_together(LENGTH_AGREEMENT)
        by_length: dict[int, list[int]] = {}
        for process, n in enumerate(lengths):
            by_length.setdefault(n, []).append(process)
        told = "; ".join(f"len(dataset) = {n} on process(es) {ps}"
                         for n, ps in by_length.items())
        raise FleetConfigError(
            f"DistributedBatchSampler: the processes' datasets differ in length ({told}); "
            "every process must build the same dataset (the sampler splits it by index), "
            "or the processes get different numbers of batches and the job hangs"
        )
