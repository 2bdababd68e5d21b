"""fleet.checkpoint: whole training states, saved atomically, resumed exactly.

Two levels, neither ever pickles:

* :func:`save` / :func:`load`, Paddle's ``paddle.save`` / ``paddle.load`` for
  state dicts, one file (a zip of ``.npy`` arrays and a JSON tree:
  ``fleet/checkpoint/_file.py``)::

      fleet.save(model.state_dict(), "model.pdparams")
      model.set_state_dict(fleet.load("model.pdparams"))

* :class:`CheckpointManager` for training, on orbax-checkpoint (arrays in
  tensorstore, metadata in JSON): model (every variable: parameters,
  batch-norm statistics, RNG streams), optimizer, loader position, RNG keys,
  step, epoch and metadata, from every process, each array written once; keeps
  the last ``max_to_keep``, saves every N steps or seconds, asynchronously::

      manager = fleet.CheckpointManager("ckpt", max_to_keep=3, save_interval_steps=100)
      restored = manager.restore_latest(model=model, optimizer=opt, loader=loader)
      start = 0 if restored is None else restored.step + 1
      for step in range(start, total_steps):
          ...
          manager.save(step, model=model, optimizer=opt, loader=loader)
      manager.close()

What is checked (a CRC-32 of every array, verified when it is read; one writer
a directory; collective calls that cannot hang; atomic, crash-safe writes):
docs/checkpoints.md, and the modules below. A checkpoint holds replicated state
once and sharded state shard by shard, read into the sharding of the arrays it
is restored into, so any number of processes can restore one written by any
other number.

The folder, one idea a module:

==================  ===========================================================
``_io.py``          ``fleet.save`` / ``fleet.load``: the reading of files and
                    of the orbax directories fleet wrote
``_atomic.py``      ``fleet.save``'s atomic write, and the removal of what
                    killed writers left
``_file.py``        the file ``fleet.save`` writes (a zip of ``.npy`` and JSON)
``_manager.py``     :class:`CheckpointManager`: the public class, save policy
``_open.py``        opening a manager's directory: created, writable, locked,
                    and the steps an earlier writer never finished
``_lock.py``        one writer a directory: the lock file and its ``flock``
``_state.py``       what a manager call takes: what a checkpoint holds
                    (``Contents``) and how its parts are read from live
                    objects and put back; its other arguments, and that every
                    process makes it (a bounded wait)
``_tree.py``        training state as flat ``{dotted path: leaf}`` dicts, and
                    how two of them differ
``_meta.py``        a step's ``meta`` JSON, its checksums summed in the
                    background, the orbax handlers of a step's items
``_restore.py``     restoring a step (checked, verified), falling back from a
                    damaged step to the newest intact one; :class:`Restored`
``_pending.py``     a save in flight: its failure, its end at interpreter exit
``_integrity.py``   the CRC-32 of every array shard, written and verified
``_settle.py``      orbax's reads, settled: a damaged array leaves nothing
                    running in orbax's event loop when the error is raised
``_disk.py``        whether a failed save failed because the disk is full, or
                    the directory is read-only
``_errors.py``      :class:`FleetCheckpointError` and its kin
==================  ===========================================================

Imports: the package's core (``fleet._*`` modules: ``_agree``, ``_compat``,
``_errors``, ``_sharding``, ``_tree``, ``_world``), jax, flax, numpy and
orbax-checkpoint; never ``fleet.hapi``, ``fleet.launch`` or ``fleet.io`` (a
loader is anything with ``state_dict()`` / ``set_state_dict()``), and the core
never imports this folder.
"""

from fleet.checkpoint._errors import FleetCheckpointError
from fleet.checkpoint._io import load, save
from fleet.checkpoint._manager import CheckpointManager
from fleet.checkpoint._restore import Restored

__all__ = [
    "CheckpointManager",
    "FleetCheckpointError",
    "Restored",
    "load",
    "save",
]
