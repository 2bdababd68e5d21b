"""The suite's three tiers (docs/tests.md).

``python -m pytest -q`` runs the default tier: every package, every table on 4
devices, and tests/test_contract.py's tables on 1 device as well (fleet's
single-device path: ``devices(..., one=True)``), the one fleetrun job of
tests/test_two_processes.py, the checkpoint integrity checks and the examples'
short runs. ``python -m pytest -q -m slow`` runs the slow tier: the core tables'
other device counts (``devices(..., core=True)``: the contract, the equivalence
tables, ZeRO's stages, whose shards depend on the count), the multi-process fault
cases and watchdog waits, the examples' full runs, and long tests whose property a
default-tier test also checks (a second optimizer of a ZeRO, LARS/LAMB, no_sync
(Adam: SGD sees the gradient's scale) or check_nan_inf table, a second ``k_steps``
of gradient_merge, a second device count of check_nan_inf's outputs (3 stays: the
uneven mean), a second moment of kill -9 during a save, checkpoints moved between
sharded and unsharded runs (also across processes in test_two_processes.py), the
composed strategy through ``fleet.Model`` and with sharding, ZeRO's CNN/hybrid
run, separate clip_by_global_norm, Adafactor and per-slice-norm runs (the default
tier: the hybrid run's binding clip and LAMB, the centred transform's refusal), the
sharded step's no-patching check, the L-BFGS cookbook run (the default tier: the
gradient of an all-reduced loss), the CIFAR example's ResNet step against one
device (global-batch BatchNorm: tests/test_batch_norm.py)). ``.ci/run`` runs
these two (the default tier on both stacks), within its 20 minutes.

``python -m pytest -q -m extended`` runs the extended tier, which ``.ci/run
--extended`` adds: the other tables' other device counts (a combination across
replicas, a draw, a metric: what depends on the count is the core's, and the core
tables check it at every count) and the default tier's costly tests that repeat a
property a cheaper one checks (tests/costly_tests.txt, :func:`mark_costly`).

A test of another tier carries its mark (:data:`slow`, :data:`extended`): a whole
file through ``pytestmark``, one test or one table row through :func:`devices`
or ``pytest.param(..., marks=slow)``, a costly test through its line in
tests/costly_tests.txt.
"""

import re
from collections import defaultdict
from pathlib import Path

import pytest

slow = pytest.mark.slow
extended = pytest.mark.extended
DEFAULT_DEVICES = (4,)


def devices(*counts: int, one: bool = False, core: bool = False) -> list:
    """A table's device counts: those outside :data:`DEFAULT_DEVICES` (and 1, with
    ``one``) are slow for a core table (``core``), extended for the others."""
    default = (1, *DEFAULT_DEVICES) if one else DEFAULT_DEVICES
    other = slow if core else extended
    return [n if n in default else pytest.param(n, marks=other) for n in counts]


def replicas(*counts: int) -> list:
    """A table's device counts for what fleet does across replicas only (a
    replica's rows of a draw, a metric's global update, a combination of the
    replicas' outputs: identities on one replica): 4 in the default tier, the
    others (1 included) extended."""
    return [n if n == 4 else pytest.param(n, marks=extended) for n in counts]


def stages() -> list:
    """ZeRO's stages for a table: stage 2 in the default tier, stage 1 in the slow one
    (stage 1 runs in the default tier's other sharding tests)."""
    return [pytest.param(1, marks=slow), 2]


COSTLY = Path(__file__).with_name("costly_tests.txt")


def costly() -> dict[str, pytest.MarkDecorator]:
    """tests/costly_tests.txt: each listed test's tier mark, by node id."""
    return {nodeid: mark for nodeid, (mark, _) in _costly_lines().items()}


def covers() -> dict[str, str]:
    """The extended functions of tests/costly_tests.txt that keep no row in
    ``.ci/run``, each with the test of the same property that runs there
    (``# covered by NODE``)."""
    return {nodeid.split("[")[0]: cover for nodeid, (_, cover) in _costly_lines().items() if cover}


def _costly_lines() -> dict[str, tuple[pytest.MarkDecorator, str | None]]:
    entries, tier = {}, None
    for line in COSTLY.read_text().splitlines():
        line, _, comment = line.strip().partition("  # ")
        if header := re.fullmatch(r"\[(slow|extended)\]", line):
            tier = {"slow": slow, "extended": extended}[header.group(1)]
        elif line and not line.startswith("#"):
            entries[line] = (tier, comment.removeprefix("covered by ") or None)
    return entries


def mark_costly(items: list, args: list[str]) -> None:
    """Marks the costly tests of tests/costly_tests.txt with their tier, and gives
    each test one tier (a slow row at an extended device count is extended). An entry
    of a collected file (of a collected function, when ``args``, the command line's
    paths, name tests) that names no collected test fails that file's tests
    (:func:`check_costly`): a renamed test or row never leaves the list stale in
    silence."""
    marks = costly()
    for item in items:
        if (mark := marks.get(item.nodeid)) is not None:
            item.add_marker(mark)
        if item.get_closest_marker("extended"):  # (a slow row of an extended count: extended)
            item.own_markers[:] = [m for m in item.own_markers if m.name != "slow"]
    collected = {item.nodeid for item in items}
    narrowed = any("::" in arg for arg in args)
    stale = defaultdict(list)
    for nodeid in marks.keys() - collected:
        stale[_scope(nodeid, narrowed)].append(nodeid)
    for item in items:
        item.stale_costly = stale.get(_scope(item.nodeid, narrowed), [])


def check_costly(item) -> None:
    """Fails a test whose file has a stale entry in tests/costly_tests.txt."""
    if stale := getattr(item, "stale_costly", None):
        pytest.fail(f"{COSTLY.name} names tests that were not collected: {', '.join(stale)}. "
                    "Write each as `pytest --collect-only -q` prints its node id, or remove it.",
                    pytrace=False)


def _scope(nodeid: str, narrowed: bool) -> str:
    """A node id's file, or its test function when the command line named tests."""
    return nodeid.split("[")[0] if narrowed else nodeid.split("::")[0]
