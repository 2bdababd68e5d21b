"""What fleetrun prints before the script's first line (issue 38, item 3).

By default one line says what starts where and where the logs go (torchrun prints
nothing); gloo's "connected to K of K peers" notes stay in the workers' logs.
``--print_config`` (``FLEETRUN_PRINT_CONFIG=1``) brings back Paddle's tables: the
configuration arguments and the first worker's environment ("Only For Debug").
Each job is a real ``fleetrun`` of the quick-start script or of a two-line one.
"""

import re
from pathlib import Path

import pytest

from tests import tiers
from tests.jobs import run

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart" / "train_fleet.py"
#: At most this many launcher lines before the script's first line.
MOST_LINES_BEFORE = 3
GLOO = re.compile(r"^\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                  r"Expected number of connected peer ranks is : \1$", re.M)


def lines_before(output: str, first: str) -> list[str]:
    lines = output.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith(first))
    return lines[:index]


@pytest.mark.timeout(120)
def test_default_output_is_one_line_then_the_script(tmp_path):
    """The quick start on 2 processes x 2 CPU devices: one launcher line before
    ``step:0``, naming the processes, their devices, the job and the logs; the
    echo leaves out gloo's connection notes, which rank 0's log keeps."""
    job = run(tmp_path, "--nproc_per_node", "2", "--cpu_devices", "2", str(QUICKSTART),
              timeout=100)
    before = lines_before(job.output, "step:0\t")
    assert len(before) <= MOST_LINES_BEFORE, "\n".join(before)
    assert before == [
        f"fleetrun: 2 processes x 2 CPU devices on this host, job {job.job_id}; rank 0's "
        f"output follows (every rank's: {job.log_dir / 'workerlog.N'})"], before
    for paddle in ("Configuration Arguments", "server_num", "Only For Debug",
                   "PADDLE_TRAINER_ENDPOINTS", "Run collective mode"):
        assert paddle not in job.output, paddle
    assert not GLOO.search(job.output), job.output
    assert GLOO.search(job.log(0)), job.log(0)  # the log keeps what gloo wrote
    assert re.search(r"^step:19\tloss:", job.output, re.M)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["flag", pytest.param("env", marks=tiers.slow)])
def test_print_config_brings_back_paddles_tables(tmp_path, how):
    """``--print_config`` or ``FLEETRUN_PRINT_CONFIG=1``: Paddle's configuration table
    (its nine rows first), the "Only For Debug" environment table, then the script."""
    script = tmp_path / "hello.py"
    script.write_text("import fleet\nfleet.init(is_collective=True)\n"
                      "print('hello from', fleet.worker_index(), flush=True)\n")
    flag, env = (["--print_config"], None) if how == "flag" else ([], {
        "FLEETRUN_PRINT_CONFIG": "1"})
    job = run(tmp_path, *flag, "--nproc_per_node", "2", "--cpu_devices", "1", str(script),
              timeout=100, env=env)
    before = lines_before(job.output, "hello from 0")
    assert before[0] == "-----------  Configuration Arguments -----------"
    assert before[1:10] == [
        "gpus: None", "ips: 127.0.0.1", f"log_dir: {job.log_dir}", "server_num: None",
        "servers:", f"training_script: {script}", "training_script_args: []",
        "worker_num: None", "workers:"]
    assert "print_config: True" in before and "nproc_per_node: 2" in before
    text = "\n".join(before)
    assert "Only For Debug" in text and re.search(r"\|\s+PADDLE_TRAINERS_NUM\s+2\s+\|", text)
    assert "rank 0's output follows" in text and "fleetrun: 2 processes" not in text
