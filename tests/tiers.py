"""The suite's two tiers (docs/tests.md).

``python -m pytest -q`` runs the default tier: every package, every table on 4
devices, and tests/test_contract.py's tables on 1 device as well (fleet's
single-device path: ``devices(..., one=True)``; the other tables' 1-device rows
are slow since the default tier outgrew its 5 minutes: about 30 s of a cold run),
the one fleetrun job of tests/test_two_processes.py, the
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
DEFAULT_DEVICES = (4,)


def devices(*counts: int, one: bool = False) -> list:
    """A table's device counts: those outside :data:`DEFAULT_DEVICES` (and 1, with
    ``one``) are slow."""
    default = (1, *DEFAULT_DEVICES) if one else DEFAULT_DEVICES
    return [n if n in default else pytest.param(n, marks=slow) for n in counts]


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
