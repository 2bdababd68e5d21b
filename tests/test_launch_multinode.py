"""Two "machines" on one: two network namespaces joined by a veth pair, each node's
launcher in its own namespace with its own hostname, which its own /etc/hosts maps
to 127.0.1.1 (Debian's default), as many real clusters start.

Node A is 10.99.0.1/24, node B 10.99.0.2/24; only these addresses are used. The
namespaces need root (``ip netns add``); without it, or without ``ip`` and
``unshare``, the tests skip and say why. The real /etc/hosts and hostname are not
touched: each launcher runs under ``unshare --uts --mount`` with a bind-mounted
hosts file of its own.
"""

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from tests import tiers
from tests.jobs import FLEETRUN, Job, free_port

pytestmark = tiers.slow

SCRIPTS = Path(__file__).parent / "scripts"
HELLO = str(SCRIPTS / "show_env.py")
NODES = {"A": "10.99.0.1", "B": "10.99.0.2"}
HOSTNAMES = {"A": "nodeA", "B": "nodeB"}
# Each launcher: its namespace, its hostname, its /etc/hosts (hostname -> 127.0.1.1).
_ENTER = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'


def _why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "creating network namespaces (ip netns add) needs root"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Namespaces:
    """Two namespaces and their veth pair; :meth:`start` runs a launcher in one."""

    def __init__(self, tmp_path: Path):
        tag = uuid.uuid4().hex[:6]
        self.names = {n: f"fleet{n}{tag}" for n in NODES}
        self.tmp_path, self.jobs = tmp_path, []
        self.hosts = {}
        for node, host in HOSTNAMES.items():
            path = tmp_path / f"hosts.{node}"
            path.write_text(f"127.0.0.1 localhost\n127.0.1.1 {host}\n")
            self.hosts[node] = path

    def create(self) -> None:
        a, b = self.names["A"], self.names["B"]
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", f"v{a}"[:15], "type", "veth", "peer", "name", f"v{b}"[:15])
        for node, ns in self.names.items():
            dev = f"v{ns}"[:15]
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{NODES[node]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")

    def start(self, node: str, *args: str, name: str, job_id: str) -> Job:
        entry = ["ip", "netns", "exec", self.names[node], "unshare", "--uts", "--mount",
                 "--", "sh", "-c", _ENTER, "enter", HOSTNAMES[node], str(self.hosts[node]),
                 FLEETRUN]
        job = Job(self.tmp_path, *args, name=name, job_id=job_id, entry=entry)
        self.jobs.append(job)
        return job

    def remove(self) -> None:
        for job in self.jobs:
            job.end()
        for ns in self.names.values():  # deleting a namespace deletes its veth end
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        # A pair made but not yet moved (a failed create) is still here.
        subprocess.run(["ip", "link", "delete", f"v{self.names['A']}"[:15]],
                       capture_output=True, timeout=30)


@pytest.fixture
def netns(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(f"two network namespaces cannot be made here: {why}")
    spaces = Namespaces(tmp_path)
    try:
        spaces.create()
    except subprocess.CalledProcessError as e:
        spaces.remove()
        pytest.skip(f"two network namespaces cannot be made here: {' '.join(e.cmd)} "
                    f"failed: {e.stderr.decode(errors='replace').strip()}")
    try:
        yield spaces
    finally:
        spaces.remove()


def _two_nodes(netns, script_args, a_args=(), b_args=(), timeout="20", master_node="A"):
    """Node A (rank 0) and node B (rank 1), same job, same master, unless told."""
    job_id = f"test-{uuid.uuid4().hex[:10]}"
    master = f"{NODES[master_node]}:{free_port()}"
    common = ["--nnodes", "2", "--master", master, "--join_timeout", timeout,
              "--cpu_devices", "1"]
    a = netns.start("A", *common, "--node_rank", "0", *a_args, *script_args,
                    name="nodeA", job_id=job_id)
    b = netns.start("B", *common, "--node_rank", "1", *b_args, *script_args,
                    name="nodeB", job_id=job_id)
    return a, b, master


@pytest.mark.timeout(240)
def test_two_namespaces_train_like_one_node(netns, jobs, tmp_path):
    one = tmp_path / "one.npz"
    job = jobs("--nproc_per_node", "2", "--cpu_devices", "1",
               str(SCRIPTS / "train_linear.py"), str(one))
    assert job.wait(timeout=120) == 0, job.output
    two = tmp_path / "two.npz"
    a, b, master = _two_nodes(netns, [str(SCRIPTS / "train_linear.py"), str(two)],
                              a_args=["--verbose_env"], timeout="60")
    for node in (a, b):
        assert node.wait(timeout=120) == 0, node.output
    got, want = dict(np.load(two)), dict(np.load(one))
    assert sorted(got) == sorted(want)
    for key in want:  # bit for bit: 2 nodes x 1 process == 1 node x 2 processes
        assert np.array_equal(got[key], want[key]), key
    # The hostname resolves to loopback; gloo listens on the veth address instead.
    assert "hostname 'nodeA' resolves to 127.0.1.1" in a.output
    assert re.search(r"\|\s+FLEET_GLOO_ADDRESS\s+10\.99\.0\.1\s+\|", a.output), a.output
    assert re.search(rf"\|\s+JAX_COORDINATOR_BIND_ADDRESS\s+{master}\s+\|", a.output)
    assert "all 2 nodes came to" in b.output


@pytest.mark.timeout(60)
def test_node_that_never_comes_is_named_at_join_timeout(netns):
    job_id = f"test-{uuid.uuid4().hex[:10]}"
    master = f"{NODES['A']}:{free_port()}"
    a = netns.start("A", "--nnodes", "2", "--node_rank", "0", "--master", master,
                    "--join_timeout", "6", HELLO, name="nodeA", job_id=job_id)
    assert a.wait(timeout=30) == 2, a.output
    assert a.seconds < 15, a.seconds
    lines = re.findall(rf"waiting for 1 of 2 nodes at {master}, \d+ s of 6 s", a.output)
    assert len(lines) >= 3, a.output
    assert f"node rank(s) 1 never came to the rendezvous at {master}" in a.output
    assert "output follows" not in a.output  # no worker started


@pytest.mark.timeout(90)
def test_same_node_rank_on_two_nodes_ends_both(netns):
    a, b, master = _two_nodes(netns, [HELLO], b_args=["--node_rank", "0"])
    for node in (a, b):
        assert node.wait(timeout=60) == 2, node.output
        assert node.seconds < 30, (node.seconds, node.output)
        assert "node rank 0 came twice: node 0 (nodeA, 10.99.0.1" in node.output
        assert "node 0 (nodeB, 10.99.0.2" in node.output
        assert f"the coordinator (node 0) is at {master}" in node.output
        assert "output follows" not in node.output


@pytest.mark.timeout(90)
def test_different_process_counts_end_both(netns):
    a, b, master = _two_nodes(netns, [HELLO], b_args=["--nproc_per_node", "2"])
    for node in (a, b):
        assert node.wait(timeout=60) == 2, node.output
        assert node.seconds < 30, (node.seconds, node.output)
        assert ("node 1 (nodeB, 10.99.0.2, 2 processes, --nnodes 2) has 2 processes "
                "(--nproc_per_node, or --gpus) but node 0 has 1") in node.output
        assert "Nodes that came: node 0 (nodeA, 10.99.0.1, 1 process" in node.output
        assert f"the coordinator (node 0) is at {master}" in node.output
        assert "output follows" not in node.output


@pytest.mark.timeout(90)
def test_master_not_on_node_0_ends_both(netns):
    a, b, master = _two_nodes(netns, [HELLO], timeout="10", master_node="B")
    assert a.wait(timeout=60) == 2, a.output
    assert a.seconds < 30, (a.seconds, a.output)
    assert f"--master {master} ({NODES['B']}) is not an address of this machine" in a.output
    assert "nodeA, node 0: 10.99.0.1" in a.output
    assert b.wait(timeout=60) == 2, b.output
    assert b.seconds < 30, (b.seconds, b.output)
    assert f"--master {master} is an address of this machine, but this is node 1" in b.output
    assert re.search(rf"waiting for 1 of 2 nodes at {master}, \d+ s of 10 s", b.output)
    assert f"no fleetrun node 0 answered at --master {master} within --join_timeout 10 s" \
        in b.output
