"""The nodes' rendezvous (fleet/launch/_rendezvous*.py) in one process: each node's
launcher side in a thread, on 127.0.0.1, with short timeouts. The same cases with
real launchers in two network namespaces: tests/test_launch_multinode.py."""

import logging
import socket
import threading
import time

import pytest

from fleet import FleetConfigError
from fleet.launch._config import LaunchConfig
from fleet.launch._rendezvous import Clock, Stopped
from fleet.launch._rendezvous_join import meet
from tests.jobs import free_port
from tests.tiers import slow


@pytest.fixture
def lines():
    """The fleet.launch logger's lines while the test runs."""
    got = []

    class Keep(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    logger = logging.getLogger("fleet.launch")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield got
    logger.removeHandler(handler)
    logger.setLevel(level)


def node(rank, master, nnodes=2, nproc=1, timeout=5.0, job_id="j"):
    return LaunchConfig(training_script="t.py", nnodes=nnodes, node_rank=rank, master=master,
                        nproc_per_node=nproc, job_id=job_id, join_timeout=timeout)


def never_stopped():
    return None


def run_all(configs, start_gap=0.0):
    """Runs ``meet`` for each config in a thread; each one's result or exception."""
    results = [None] * len(configs)

    def one(i, config):
        try:
            results[i] = meet(config, never_stopped)
        except Exception as e:  # noqa: BLE001 (the test looks at it)
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(configs)]
    for thread in threads:
        thread.start()
        time.sleep(start_gap)
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()
    return results


def test_every_node_gets_every_node():
    master = f"127.0.0.1:{free_port()}"
    results = run_all([node(2, master, 3), node(0, master, 3), node(1, master, 3)], 0.2)
    for nodes in results:
        assert [n.node_rank for n in nodes] == [0, 1, 2], results
        assert {n.nproc_per_node for n in nodes} == {1}


@pytest.mark.parametrize("second,match", [
    (dict(rank=1), r"node rank 1 came twice: node 1 \(.*, 127\.0\.0\.1, 1 process, "
                   r"--nnodes 3\) and node 1"),
    (dict(rank=2, nproc=4), r"node 2 \(.*4 processes, --nnodes 3\) has 4 processes "
                            r"\(--nproc_per_node, or --gpus\) but node 0 has 1"),
    (dict(rank=2, job_id="other"), r"says --job_id 'other' but node 0 says 'j'"),
])
def test_a_mismatch_ends_every_node_at_once(second, match):
    master = f"127.0.0.1:{free_port()}"
    rank = second.pop("rank")
    started = time.monotonic()
    results = run_all([node(0, master, 3, timeout=20), node(1, master, 3, timeout=20),
                       node(rank, master, 3, timeout=20, **second)], 0.3)
    assert time.monotonic() - started < 10
    for result in results:
        assert isinstance(result, FleetConfigError), results
        assert f"the coordinator (node 0) is at {master}" in str(result)
    for result in results:
        with pytest.raises(FleetConfigError, match=match):
            raise result


def test_other_nnodes_is_named():
    master = f"127.0.0.1:{free_port()}"
    results = run_all([node(0, master, 2), node(1, master, 3)], 0.2)
    for result in results:
        assert "says --nnodes 3 but node 0 says --nnodes 2" in str(result), results


@slow  # seconds of waiting; the mismatch cases stay in the default tier
def test_missing_node_is_awaited_then_named(lines):
    master = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(FleetConfigError, match=rf"node rank\(s\) 1 never came to the "
                                               rf"rendezvous at {master} within "
                                               r"--join_timeout 3 s"):
        meet(node(0, master, timeout=3), never_stopped)
    assert time.monotonic() - started < 6
    waiting = [line for line in lines if f"waiting for 1 of 2 nodes at {master}" in line]
    assert len(waiting) >= 2, lines
    assert "s of 3 s" in waiting[0] and "missing node rank 1" in waiting[0]


@slow  # seconds of waiting; the mismatch cases stay in the default tier
def test_no_node_0_is_named(lines):
    master = f"127.0.0.1:{free_port()}"
    with pytest.raises(FleetConfigError, match=rf"node 1: no fleetrun node 0 answered at "
                                               rf"--master {master} within --join_timeout "
                                               r"2 s \(last: Connection refused\)"):
        meet(node(1, master, timeout=2), never_stopped)
    assert any("node 0, the coordinator's: Connection refused" in line for line in lines)


@slow  # seconds of waiting; the mismatch cases stay in the default tier
def test_a_stranger_on_the_port_is_named_and_ignored(lines):
    master = f"127.0.0.1:{free_port()}"
    host, port = master.split(":")

    def stranger():
        time.sleep(0.3)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"GET / HTTP/1.0\n")
            time.sleep(0.5)

    thread = threading.Thread(target=stranger)
    thread.start()
    results = run_all([node(0, master), node(1, master)], 1.2)
    thread.join()
    assert all(isinstance(r, list) and len(r) == 2 for r in results), results
    assert any("is not a fleetrun node's (it sent b'GET / HTTP/1.0')" in line
               for line in lines), lines


def test_a_signal_stops_the_wait():
    master = f"127.0.0.1:{free_port()}"
    with pytest.raises(Stopped) as stopped:
        meet(node(0, master), lambda: 15)
    assert stopped.value.signum == 15


def test_waiting_lines_every_thirty_seconds_at_most():
    now = [0.0]
    clock = Clock(300, now=lambda: now[0])
    due = []
    for second in range(0, 95):
        now[0] = float(second)
        if clock.report_due():
            due.append(second)
    assert due == [30, 60, 90] and clock.of_total() == "94 s of 300 s"
    assert Clock(6).interval == 1.0
