"""Several processes, same rows: every process of a job passing the same batch.

In a multi-process job a numpy batch is this process's own rows of the global
batch (and so is a ``jax.Array`` on this process's devices only). A script
written for one card that passes its whole batch on every process -- the four
steps, run under ``fleetrun --nproc_per_node 2`` as they stand -- trains on N
copies of the same rows. Mean losses and gradients over N copies equal those
over one, so the losses even match the single-card run and nothing shows the
mistake: every process computes what one process alone would, and an epoch
takes as many steps as on one card.

The check. On a step's first call with each program, the processes already
exchange what they traced (:func:`fleet.step._guards.agree_program`); each adds a
fingerprint of its rows to that exchange (no extra round trip):
:func:`fingerprint`, a SHA-1 of every process-local leaf's shape, dtype and
bytes, and whether the batch holds at least two distinct rows. When every
process's digest is the same and the batch holds two distinct rows, every
process raises the same :class:`FleetError` at that call, before anything runs
(each decides from the same exchanged values, so none waits for another).

Why this rule:

* exact bytes, not a sample of rows: processes holding different rows never
  match (short of a SHA-1 collision);
* at least two distinct rows: a constant batch (an all-zeros warm-up call, a
  batch of padding) is the same everywhere by design, not by mistake. Such a
  call leaves the check undecided, and the step checks again at its next calls
  with that program (at most :data:`RECHECKS`, one exchange each, only while
  undecided), so a warm-up call does not turn the check off;
* a global ``jax.Array`` (one that spans processes) is the global batch: it is
  not fingerprinted, and a batch made only of such arrays is not checked.

What it still refuses: rows that really are each process's own, equal on every
process, with two distinct rows -- a dataset smaller than the global batch,
which ``DistributedBatchSampler`` pads by repeating it so that every process
gets the same indices. Pass such a batch as a global ``jax.Array`` (fleet.io's
``DataLoader`` does).

Cost, on a CIFAR-sized batch (256 x 32 x 32 x 3 float32, 3.1 MB, one CPU
core): the SHA-1 1.4 ms and the distinct-rows test 0.3 ms, at first calls only
(calls that also compile the step).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import numpy as np

from fleet._errors import FleetError
from fleet.runtime._agree import agree, raise_together

#: Calls after an undecided first call (a constant batch) that check again.
RECHECKS = 8

OWN, SAME, UNDECIDED = "own rows", "same rows", "undecided"


def _host_rows(x: Any) -> np.ndarray | None:
    """A batch leaf's rows on the host, if they are this process's own
    (``fleet.step._global_arrays``'s rule: anything but a ``jax.Array`` that spans
    processes) and numbers (``fleet.step._global_arrays`` refuses other numpy arrays)."""
    if isinstance(x, jax.Array) and (not x.is_fully_addressable or jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.extended)):  # (PRNG keys)
        return None
    x = np.asarray(x)
    return np.ascontiguousarray(x) if x.dtype.kind in "biufc" else None


def fingerprint(batch: Any) -> dict | None:
    """``{"digest", "distinct", "rows"}`` of the process-local leaves of ``batch``
    (a pytree of arrays), or ``None`` when it has none (global arrays only)."""
    leaves = [r for r in map(_host_rows, jax.tree.leaves(batch)) if r is not None]
    if not leaves:
        return None
    digest, distinct = hashlib.sha1(), False
    for x in leaves:
        digest.update(f"{x.shape}{x.dtype.str};".encode())
        digest.update(x.reshape(-1).view(np.uint8))
        if not distinct and x.ndim and len(x) > 1:
            rows = x.reshape(len(x), -1).view(np.uint8)  # bytes: NaN rows compare too
            distinct = bool((rows[1:] != rows[0]).any())
    rows = len(leaves[0]) if leaves[0].ndim else 0
    return {"digest": digest.hexdigest(), "distinct": distinct, "rows": rows}


def decide(prints: list) -> str:
    """:data:`SAME` when every process's rows are the same and hold two distinct
    rows, :data:`UNDECIDED` when they are the same constant rows, else :data:`OWN`
    (``prints``: every process's :func:`fingerprint`, in rank order)."""
    if len(prints) < 2 or any(p is None for p in prints):
        return OWN
    if len({p["digest"] for p in prints}) > 1:
        return OWN
    return SAME if all(p["distinct"] for p in prints) else UNDECIDED


def same_rows_message(step: str, positions: list, prints: list, call: int) -> str:
    n, rows = len(prints), prints[0]["rows"]
    where = ", ".join(map(str, positions))
    return (
        f"every process passed the same batch rows to the step {step!r} (call {call}, "
        f"batch argument(s) {where}: {rows} rows, identical on all {n} processes). In a "
        "multi-process job a numpy batch is this process's own rows of the global batch, "
        f"so the global batch is {n} copies of the same rows and every process computes "
        "what one would alone. Pass each process its own rows: "
        "`x[jax.process_index()::jax.process_count()]` (or this process's slice of the "
        "global batch), or load the data with fleet.io's DataLoader / "
        "DistributedBatchSampler, or pass a global jax.Array (it is the global batch). "
        "(Checked at a step's first call with each batch shape, on batches that hold at "
        "least two distinct rows.)"
    )


class SameRows:
    """A step's check (see the module docstring): it decides from each new
    program's exchange, and keeps the programs still undecided."""

    def __init__(self, step: str):
        self.step = step
        self._left: dict = {}  # program key -> checks left

    def due(self, key: Any) -> bool:
        """Whether a call of program ``key`` checks again (it is undecided)."""
        return key in self._left

    def check(self, key: Any, prints: list, positions: list, call: int) -> None:
        """Decides from every process's fingerprint; raises on every process when
        they passed the same rows (see the module docstring)."""
        verdict = decide(prints)
        if verdict == SAME:
            raise_together(f"rows/{self.step}")
            raise FleetError(same_rows_message(self.step, positions, prints, call))
        if verdict == UNDECIDED:
            left = self._left.get(key, RECHECKS + 1) - 1
            if left > 0:
                self._left[key] = left
                return
        self._left.pop(key, None)

    def recheck(self, key: Any, batch: list, positions: list, call: int) -> None:
        """A call of an undecided program: one exchange of fingerprints, then
        :meth:`check`."""
        texts = agree(f"rows/{self.step}", json.dumps(fingerprint(batch)))
        self.check(key, [json.loads(t) for t in texts], positions, call)
