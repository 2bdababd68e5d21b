"""The suite's two tiers (docs/tests.md).

``python -m pytest -q`` runs the default tier: every package, every table on 1
and 4 devices (the tables of what fleet does across replicas only -- randomness,
metrics, outputs, loops -- on 4: :func:`replicas`), the one fleetrun job of tests/test_two_processes.py, the
checkpoint integrity checks and the examples' short runs. ``python -m pytest -q
-m slow`` runs the rest: the other device counts, the multi-process fault cases
and watchdog waits, the examples' full runs, and long tests whose property a
default-tier test also checks (a second optimizer of a ZeRO, LARS/LAMB,
no_sync (Adam: SGD sees the gradient's scale) or check_nan_inf table, a second
``k_steps`` of gradient_merge, a second device count of check_nan_inf's
outputs (3 stays: the uneven mean), a second moment of kill -9 during a save,
checkpoints moved between sharded and unsharded runs (also across processes in
test_two_processes.py), the composed strategy through ``fleet.Model`` and with
sharding, ZeRO's CNN/hybrid run, separate clip_by_global_norm, Adafactor and
per-slice-norm runs (the default tier: the hybrid run's binding clip and LAMB,
the centred transform's refusal), the sharded step's no-patching check, the
L-BFGS cookbook run (the default tier: the gradient of an all-reduced loss),
the CIFAR example's ResNet step against one device (global-batch BatchNorm:
tests/test_batch_norm.py)). A test of the slow tier carries ``pytest.mark.slow``
(:data:`slow`): a whole file through ``pytestmark``, one test or one table row
through :func:`devices` or ``pytest.param(..., marks=slow)``.
"""

import pytest

slow = pytest.mark.slow
DEFAULT_DEVICES = (1, 4)


def devices(*counts: int) -> list:
    """A table's device counts: those outside :data:`DEFAULT_DEVICES` are slow."""
    return [n if n in DEFAULT_DEVICES else pytest.param(n, marks=slow) for n in counts]


def replicas(*counts: int) -> list:
    """A table's device counts for what fleet does across replicas only (a
    replica's rows of a draw, a metric's global update, a combination of the
    replicas' outputs: identities on one replica): 4 in the default tier, the
    others (1 included) slow."""
    return [n if n == 4 else pytest.param(n, marks=slow) for n in counts]


def stages() -> list:
    """ZeRO's stages for a table: stage 2 in the default tier, stage 1 in the slow one
    (stage 1 runs in the default tier's other sharding tests)."""
    return [pytest.param(1, marks=slow), 2]
