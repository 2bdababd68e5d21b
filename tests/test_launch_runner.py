"""fleet/launch/_run.py, how fleetrun runs a script in each worker: the script
sees what ``python SCRIPT ARGS`` would give it, and its exit status is the
worker's, with no part of the interpreter replaced (issue 19)."""

import subprocess
import sys
import textwrap

import pytest

from fleet.launch._agent import RUNNER
from tests.jobs import clean_environ

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import os
    import sys

    def square(x):  # defined in __main__: a spawn child must find it
        return x * x

    if __name__ == "__main__":
        exit_before = sys.exit
        print("argv", sys.argv[1:])
        print("file", os.path.basename(__file__))
        print("path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
        with mp.get_context("spawn").Pool(1) as pool:
            print("spawned", pool.map(square, [3]))
        print("exit untouched", sys.exit is exit_before)
        how = sys.argv[1]
        if how == "exit":
            sys.exit(7)
        if how == "message":
            sys.exit("bad input")
        if how == "raise":
            def inner():
                raise ValueError("boom")
            inner()
""")


def run(tmp_path, how):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-u", RUNNER, str(script), how, "x y"],
                          env=clean_environ(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("how, code", [("ok", 0), ("exit", 7), ("message", 1), ("raise", 1)])
def test_the_script_sees_what_python_gives_it_and_its_status_is_kept(tmp_path, how, code):
    out = run(tmp_path, how)
    direct = subprocess.run([sys.executable, "-u", str(tmp_path / "script.py"), how, "x y"],
                            env=clean_environ(), cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    print(out.stdout, out.stderr)
    assert out.returncode == direct.returncode == code
    assert out.stdout == direct.stdout
    assert f"argv ['{how}', 'x y']" in out.stdout
    assert "file script.py" in out.stdout and "path0 True" in out.stdout
    assert "spawned [9]" in out.stdout and "exit untouched True" in out.stdout
    if how == "message":
        assert out.stderr.strip() == direct.stderr.strip() == "bad input"
    if how == "raise":  # the same traceback as Python's own: the runner's frames left out
        assert out.stderr == direct.stderr
        assert "_run.py" not in out.stderr and "runpy" not in out.stderr
