"""tests/tiers.py: each test gets one tier, and the costly list cannot go stale."""

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import tiers

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Item:  # what tiers.mark_costly reads of a pytest item
    nodeid: str
    own_markers: list = field(default_factory=list)

    def add_marker(self, mark):
        self.own_markers.append(mark.mark)

    def get_closest_marker(self, name):
        return next((m for m in self.own_markers if m.name == name), None)


@pytest.fixture
def costly_file(tmp_path, monkeypatch):
    path = tmp_path / "costly_tests.txt"
    path.write_text("# a comment\n[slow]\ntests/test_a.py::test_x[4]\n\n"
                    "[extended]\ntests/test_a.py::test_y  # covered by tests/test_b.py::test_z\n")
    monkeypatch.setattr(tiers, "COSTLY", path)
    return path


def test_the_listed_tests_get_their_tier_and_an_extended_row_is_not_slow(costly_file):
    items = [Item("tests/test_a.py::test_x[4]"), Item("tests/test_a.py::test_x[2]"),
             Item("tests/test_a.py::test_y", [tiers.slow.mark]), Item("tests/test_b.py::test_z")]
    tiers.mark_costly(items, ["tests"])
    assert [[m.name for m in item.own_markers] for item in items] == [["slow"], [], ["extended"], []]
    assert tiers.covers() == {"tests/test_a.py::test_y": "tests/test_b.py::test_z"}


@pytest.mark.parametrize(("collected", "args"), [
    (["tests/test_a.py::test_x[8]", "tests/test_a.py::test_y"], ["tests"]),  # a changed row
    (["tests/test_a.py::test_y"], ["tests/test_a.py"]),  # a renamed function
    (["tests/test_a.py::test_x[2]"], ["tests/test_a.py::test_x"]),  # the row, named tests
])
def test_an_entry_that_names_no_collected_test_fails_its_files_tests(costly_file, collected, args):
    items = [Item(nodeid) for nodeid in collected]
    tiers.mark_costly(items, args)
    for item in items:
        with pytest.raises(pytest.fail.Exception,
                           match=r"names tests that were not collected: tests/test_a.py::test_x\[4\]\. "):
            tiers.check_costly(item)


def test_an_entry_outside_what_was_collected_is_not_checked(costly_file):
    asked_for_y = [Item("tests/test_a.py::test_y")]  # test_x was not asked for
    other_file = [Item("tests/test_b.py::test_z")]  # nor test_a.py
    tiers.mark_costly(asked_for_y, ["tests/test_a.py::test_y"])
    tiers.mark_costly(other_file, ["tests"])
    for item in asked_for_y + other_file:
        tiers.check_costly(item)
    assert [m.name for m in asked_for_y[0].own_markers] == ["extended"]


def test_the_costly_list_is_well_formed():
    """The file's form: a tier header before the entries, node ids of test files
    (that each names a collected test, mark_costly checks at every collection)."""
    marks = tiers.costly()
    assert marks and all(mark in (tiers.slow, tiers.extended) for mark in marks.values())
    assert all(nodeid.startswith("tests/test_") and "::test_" in nodeid for nodeid in marks)


@tiers.slow  # (two collections of the whole suite)
def test_every_test_function_keeps_a_row_outside_the_extended_tier():
    """`.ci/run` runs the default and the slow tier: a function whose every row is
    extended runs there only through the test its costly_tests.txt entry names
    (``# covered by``), which must run there."""
    def functions(markexpr):
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                              "-p", "no:cacheprovider", "-m", markexpr],
                             cwd=ROOT, capture_output=True, text=True, timeout=200)
        assert run.returncode in (0, 5), run.stdout[-2000:] + run.stderr[-2000:]  # (5: none)
        return {line.split("[")[0] for line in run.stdout.splitlines() if "::" in line}
    extended, in_ci = functions("extended"), functions("not extended")
    assert extended and in_ci
    assert functions("slow and extended") == set()  # (one tier each: a file's pytestmark stays)
    covers = tiers.covers()
    assert extended - in_ci == covers.keys()
    assert set(covers.values()) <= in_ci
