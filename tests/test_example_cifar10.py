"""examples/cifar10: the loader of the official format, the download (against a
local HTTP server, never the real address), and the script on one process and
through fleetrun on an archive the test writes in the official format.
"""

import hashlib
import importlib.util
import io
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from tests import jobs
from tests.tiers import slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cifar10"
PER_BATCH, N_TEST = 16, 25  # 80 training images in 5 batches; the test set pads on 4 replicas


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


data = _load("cifar10_example_data", EXAMPLE / "data.py")


def write_archive(path: Path, seed: int = 0) -> tuple[str, dict]:
    """A small cifar-10-python.tar.gz in the official format; returns its MD5 and the
    images (NHWC) and labels it holds."""
    rng = np.random.RandomState(seed)
    members, want = {}, {"train": ([], []), "test": ([], [])}
    names = [(f"data_batch_{i}", "train", PER_BATCH) for i in range(1, 6)]
    for name, split, n in [*names, ("test_batch", "test", N_TEST)]:
        images = rng.randint(0, 256, (n, 32, 32, 3)).astype(np.uint8)
        labels = rng.randint(0, 10, n)
        rows = images.transpose(0, 3, 1, 2).reshape(n, 3072)  # R plane, G plane, B plane
        members[name] = pickle.dumps({b"batch_label": name.encode(), b"labels": labels.tolist(),
                                      b"data": rows, b"filenames": [b"x.png"] * n}, protocol=2)
        want[split][0].append(images)
        want[split][1].append(labels)
    members["batches.meta"] = pickle.dumps({b"label_names": [c.encode() for c in data.CLASSES]})
    with tarfile.open(path, "w:gz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    return md5, {k: (np.concatenate(x), np.concatenate(y)) for k, (x, y) in want.items()}


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    path = tmp_path_factory.mktemp("cifar") / data.ARCHIVE
    md5, want = write_archive(path)
    return path, md5, want


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickled a file whose MD5 was not checked")

    monkeypatch.setattr(data.pickle, "load", refuse)


# -- reading the official format -----------------------------------------------------------

def test_reads_the_official_archive_and_the_extracted_directory(archive, tmp_path):
    path, md5, want = archive
    assert data.locate(path.parent) == path
    got = data.read(path, md5=md5)
    for split, n in (("train", 5 * PER_BATCH), ("test", N_TEST)):
        images, labels = got[split]
        assert images.shape == (n, 32, 32, 3) and images.dtype == np.uint8
        np.testing.assert_array_equal(images, want[split][0])
        np.testing.assert_array_equal(labels, want[split][1])
    with tarfile.open(path) as tar:
        tar.extractall(tmp_path, filter="data")
    assert data.locate(tmp_path) == tmp_path / data.DIRNAME
    assert data.locate(tmp_path / data.DIRNAME) == tmp_path / data.DIRNAME
    extracted = data.read(tmp_path / data.DIRNAME)
    np.testing.assert_array_equal(extracted["train"][0], want["train"][0])
    assert data.locate(tmp_path / "nothing") is None


def test_an_archive_with_another_md5_is_not_unpickled(archive, no_unpickling):
    path, md5, _ = archive
    with pytest.raises(data.ChecksumError, match=rf"has MD5 {md5}, expected {data.MD5}; .*not "
                                                 r"opened.*--md5"):
        data.read(path)  # the published MD5 by default


# -- downloading, from a local server ----------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        srv = self.server
        body, asked = srv.payload, self.headers.get("Range")
        srv.ranges.append(asked)
        start = int(asked.split("=")[1].split("-")[0]) if asked and srv.honor_range else 0
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        if srv.breaks:  # send a part, then drop the connection
            srv.breaks -= 1
            self.wfile.write(body[start:start + srv.break_after])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server(archive):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.payload = archive[0].read_bytes()
    srv.ranges, srv.honor_range, srv.breaks, srv.break_after = [], True, 0, 0
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/{data.ARCHIVE}"
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join()


def test_download_checks_the_md5_and_renames_into_place(server, archive, tmp_path):
    progress = io.StringIO()
    dest = data.download(server.url, tmp_path / data.ARCHIVE, archive[1], file=progress)
    assert dest.read_bytes() == server.payload and server.ranges == [None]
    assert list(tmp_path.iterdir()) == [dest]  # no .part left
    assert progress.getvalue().splitlines()[-1].startswith(f"{data.ARCHIVE}  100%")


def test_a_broken_download_resumes_with_a_range_request(server, archive, tmp_path):
    server.breaks, server.break_after = 1, len(server.payload) // 3
    dest, part = tmp_path / data.ARCHIVE, tmp_path / (data.ARCHIVE + ".part")
    with pytest.raises(data.DataError, match=r"failed 1 times \(the transfer broke off.*"
                                             r"partial file .*\.part is kept: run again"):
        data.download(server.url, dest, archive[1], attempts=1, file=io.StringIO())
    assert part.stat().st_size == server.break_after and not dest.exists()
    data.download(server.url, dest, archive[1], file=io.StringIO())  # the next run
    assert server.ranges == [None, f"bytes={server.break_after}-"]
    assert dest.read_bytes() == server.payload and not part.exists()

    # Within one run: the next attempt resumes.
    server.breaks, server.ranges = 1, []
    dest.unlink()
    data.download(server.url, dest, archive[1], attempts=2, file=io.StringIO())
    assert server.ranges == [None, f"bytes={server.break_after}-"]
    assert dest.read_bytes() == server.payload


def test_a_server_without_range_support_restarts_cleanly(server, archive, tmp_path):
    server.honor_range = False
    (tmp_path / (data.ARCHIVE + ".part")).write_bytes(b"stale bytes")
    dest = data.download(server.url, tmp_path / data.ARCHIVE, archive[1], file=io.StringIO())
    assert server.ranges == ["bytes=11-"]  # asked to resume, got the whole file
    assert dest.read_bytes() == server.payload


def test_a_download_with_the_wrong_md5_is_deleted_unopened(server, tmp_path, no_unpickling):
    with pytest.raises(data.ChecksumError, match=rf"has MD5 \w+, expected {data.MD5}; it was "
                                                 r"deleted and not opened"):
        data.download(server.url, tmp_path / data.ARCHIVE, data.MD5, file=io.StringIO())
    assert list(tmp_path.iterdir()) == []


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/{data.ARCHIVE}"


def test_offline_says_so_and_names_the_options(tmp_path):
    with pytest.raises(data.OfflineError, match=r"cannot reach .* looks offline\. put "
                                                r"cifar-10-python\.tar\.gz .* --data-dir DIR, "
                                                r"or .* --synthetic"):
        data.download(closed_port_url(), tmp_path / data.ARCHIVE, data.MD5)
    assert list(tmp_path.iterdir()) == []


def test_offline_advice_is_given_once_and_the_failure_is_remembered(tmp_path, monkeypatch):
    """Issue 38, item 5: the banner gave the --data-dir advice twice (its own and the
    error's), and every run waited for the network again. OfflineError.what is the
    error without the advice; the cache remembers the failure for data.RETRY_AFTER
    seconds, for that URL only."""
    monkeypatch.setitem(sys.modules, "data", data)
    train = _load("cifar10_example_train_offline", EXAMPLE / "train.py")
    url = closed_port_url()
    with pytest.raises(data.OfflineError) as caught:
        data.download(url, tmp_path / data.ARCHIVE, data.MD5)
    assert caught.value.what.startswith(f"cannot reach {url} (") and "--data-dir" not in (
        caught.value.what)
    assert str(caught.value).count("--data-dir") == 1
    banner = train.offline_banner(caught.value.what)
    assert banner.count("--data-dir") == 1 and "cannot reach" in banner

    assert data.recent_offline(tmp_path, url) is None
    data.remember_offline(tmp_path, url, caught.value.what)
    recent = data.recent_offline(tmp_path, url)
    assert recent.startswith(caught.value.what + ", 0 min ago; a run tries again 60 min")
    assert str(tmp_path / data.FAILED_MARK) in recent
    assert data.locate(tmp_path) is None  # the mark is not the data
    assert data.recent_offline(tmp_path, url + "?mirror") is None  # another URL: try it
    assert data.recent_offline(tmp_path, url, within=0) is None  # an old failure: try again
    data.forget_offline(tmp_path)
    assert data.recent_offline(tmp_path, url) is None
    assert train.plural(1, "device") == "1 device" and train.plural(2, "process") == (
        "2 processes")


# -- the script ------------------------------------------------------------------------------

def run_script(args, devices, cwd, timeout=120, check=True):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(EXAMPLE / "train.py"), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@slow
def test_downloads_then_trains_alike_on_one_process_and_through_fleetrun(
        server, archive, tmp_path):
    """4 replicas either way (1 process x 4 devices; fleetrun: 2 processes x 2 devices):
    the same global batches and augmentation, so the same losses and accuracies."""
    common = ["--md5", archive[1], "--epochs", "2", "--batch-size", "8", "--log-freq", "2"]
    single = run_script(["--data-dir", "cache", "--url", server.url, *common,
                         "--output-dir", "single"], devices=4, cwd=tmp_path)
    assert (tmp_path / "cache" / data.ARCHIVE).read_bytes() == server.payload
    assert "downloading" in single.stdout and "100%" in single.stderr
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "single" / "curves.png").stat().st_size > 0
    else:
        assert "matplotlib is not installed: skipped the plot" in single.stdout

    job = jobs.two_processes(tmp_path, EXAMPLE / "train.py", "--data-dir", "cache", *common,
                             "--output-dir", "fleetrun")
    assert server.ranges == [None]  # the fleetrun job found the archive: no download
    assert re.search(r"^\[validation\] epoch 2/2 accuracy/loss:", job.output, re.M)  # rank 0
    assert "validation" not in job.log(1)

    a = json.loads((tmp_path / "single" / "metrics.json").read_text())
    b = json.loads((tmp_path / "fleetrun" / "metrics.json").read_text())
    assert (a["devices"], a["processes"], b["devices"], b["processes"]) == (4, 1, 4, 2)
    assert a["global_batch"] == b["global_batch"] == 32 and not a["synthetic"]
    for x, y in zip(a["epochs"], b["epochs"]):
        assert x["val_images"] == y["val_images"] == N_TEST  # exact: padding dropped
        assert x["val_accuracy"] == y["val_accuracy"]
        for key in ("train_loss", "val_loss"):
            assert x[key] == pytest.approx(y[key], abs=1e-5)


def test_synthetic_data_is_named_in_every_accuracy_line(tmp_path):
    proc = run_script(["--synthetic", "--train-size", "512", "--test-size", "64", "--epochs",
                       "1", "--batch-size", "16", "--log-freq", "4"], devices=4, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if "accuracy" in line]
    assert lines and all(line.endswith("(synthetic data)") for line in lines)
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert steps[-1].startswith("step 8/8 [=====") and " - loss: " in steps[-1]
    assert "samples/s" in steps[-1]
    assert json.loads((tmp_path / "output/cifar10/metrics.json").read_text())["synthetic"]


def test_offline_script_names_data_dir_and_synthetic(tmp_path):
    proc = run_script(["--data-dir", str(tmp_path), "--url", closed_port_url()], devices=1,
                      cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 1
    assert "looks offline" in proc.stderr and "--data-dir DIR" in proc.stderr
    assert "--synthetic" in proc.stderr


def test_the_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "data", data)  # what train.py imports as `data`
    train = _load("cifar10_example_train", EXAMPLE / "train.py")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    train.plot([{"epoch": 1, "train_loss": 1.0, "val_loss": 1.0, "val_accuracy": 0.5}],
               tmp_path / "curves.png", "")
    assert "matplotlib is not installed: skipped the plot" in capsys.readouterr().out
    assert not (tmp_path / "curves.png").exists()


@slow
def test_resume_mid_epoch_continues_as_if_never_stopped(tmp_path):
    """--max-steps stops in the middle of epoch 2 (after saving); --resume finishes the
    job. The validation numbers after the last epoch, a function of the parameters,
    equal an uninterrupted run's exactly, and so does the epoch-1 record kept in the
    checkpoint's metadata."""
    common = ["--synthetic", "--train-size", "512", "--test-size", "64", "--epochs", "2",
              "--batch-size", "16", "--log-freq", "100", "--save-every", "3"]
    run_script([*common, "--output-dir", "straight"], devices=4, cwd=tmp_path)
    stopped = run_script([*common, "--save-dir", "ckpt", "--max-steps", "11",
                          "--output-dir", "stopped"], devices=4, cwd=tmp_path)
    assert "stopped after 11 steps" in stopped.stdout  # 8 steps an epoch: mid-epoch 2
    resumed = run_script([*common, "--save-dir", "ckpt", "--resume", "--output-dir", "resumed"],
                         devices=4, cwd=tmp_path)
    assert "resumed from step 11 (epoch 2)" in resumed.stdout
    # the resumed epoch prints its progress, counting on from where it stopped (issue 21)
    assert re.search(r"^step 8/8 \[=+\] - loss: ", resumed.stdout, re.M), resumed.stdout

    a = json.loads((tmp_path / "straight" / "metrics.json").read_text())["epochs"]
    b = json.loads((tmp_path / "resumed" / "metrics.json").read_text())["epochs"]
    assert len(a) == len(b) == 2
    timing = "images_per_sec"
    assert {k: v for k, v in a[0].items() if k != timing} == {
        k: v for k, v in b[0].items() if k != timing}
    for key in ("val_loss", "val_accuracy", "val_images"):
        assert a[1][key] == b[1][key], key
    # curves.png plots every step's loss: the records keep them, where they start
    assert len(a[1]["step_losses"]) == 8 and a[1]["first_step"] == 0
    assert len(b[1]["step_losses"]) == 5 and b[1]["first_step"] == 3
    assert b[1]["step_losses"] == a[1]["step_losses"][3:]


# -- issue 11 §1: the README's main command on a machine that cannot reach the CIFAR-10 host --

def readme_main_command() -> list[str]:
    """The fleetrun part of the README's first command (after `pip install ... &&`)."""
    text = (ROOT / "README.md").read_text()
    quick = text[text.index("## Quick start"):text.index("## Four steps")]
    line = next(line for line in quick.splitlines() if "fleetrun --nproc_per_node" in line)
    words = line.split("&&")[-1].split()
    assert words[0] == ".venv/bin/fleetrun", line
    return [jobs.FLEETRUN, *words[1:]]


@slow
def test_readme_main_command_offline_trains_on_generated_data_and_says_so(tmp_path):
    """No route to the host (the download URL is a closed loopback port), the default
    cache: the job ends with 0, a banner first, "(synthetic data)" on every accuracy
    line, metrics.json and curves.png. (The training set is cut to 512 images to keep
    the suite short; the README's sizes finish in about 2 minutes on 2 CPU cores.)"""
    command = readme_main_command()
    assert command[2:5] == ["2", "examples/cifar10/train.py", "--epochs"], command
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the README runs in the checkout
    job = jobs.run(tmp_path, *command[1:], "--train-size", "512", "--test-size", "128",
                   timeout=240, entry=command[:1],
                   env={"FLEET_DATA_HOME": str(tmp_path / "cache"),
                        "FLEET_CIFAR10_URL": closed_port_url()})
    out = job.output
    banner = out.index("NO CIFAR-10 ON THIS MACHINE: TRAINING ON GENERATED DATA")
    assert "cannot reach" in out[banner:] and "--data-dir DIR" in out[banner:]
    assert banner < out.index("Epoch 1/") < out.index("[validation] epoch 1/")
    accuracy = [line for line in out.splitlines() if "accuracy" in line]
    epochs = int(command[command.index("--epochs") + 1])
    assert len(accuracy) == epochs and all(a.endswith("(synthetic data)") for a in accuracy)
    assert re.search(r"done in \d+ s \(synthetic data\)", out)
    metrics = json.loads((tmp_path / "output/cifar10/metrics.json").read_text())
    assert metrics["synthetic"] and metrics["processes"] == 2 and len(metrics["epochs"]) == epochs
    assert metrics["epochs"][-1]["val_images"] == 128
    if importlib.util.find_spec("matplotlib") is None and os.environ.get("CI") != "true":
        assert "matplotlib is not installed: skipped the plot" in out
    else:  # CI installs the examples' extra
        assert (tmp_path / "output/cifar10/curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "cache").rglob("*.tar.gz*"))  # nothing half-written


def test_explicit_or_corrupt_data_still_fails_loudly(archive, tmp_path):
    """The fallback is for the default cache when the network is missing: an explicit
    --data-dir that cannot be filled fails (test above: offline), and so does a
    corrupt archive, given or in the cache."""
    corrupt = tmp_path / "given"
    corrupt.mkdir()
    (corrupt / data.ARCHIVE).write_bytes(archive[0].read_bytes()[:-10])
    proc = run_script(["--data-dir", str(corrupt), "--url", closed_port_url()], devices=1,
                      cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 1 and "has MD5" in proc.stderr and "was not opened" in proc.stderr
    assert "GENERATED" not in proc.stdout

    cache = tmp_path / "home" / "cifar10"
    cache.mkdir(parents=True)
    (cache / data.ARCHIVE).write_bytes(archive[0].read_bytes()[:-10])
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               JAX_PLATFORMS="cpu", FLEET_DATA_HOME=str(tmp_path / "home"),
               FLEET_CIFAR10_URL=closed_port_url())
    proc = subprocess.run([sys.executable, str(EXAMPLE / "train.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and f"{cache / data.ARCHIVE} has MD5" in proc.stderr
    assert "GENERATED" not in proc.stdout


@slow  # (tests/test_batch_norm.py checks global-batch BatchNorm in the default tier)
def test_the_resnet_step_equals_the_single_device_step(monkeypatch, make_world):
    """Issue 21: the example's ResNet (BatchNorm after every convolution), its own
    train_step (augmentation included), global-batch BatchNorm (the example's
    default): two steps on 4 devices equal two single-device steps (SGD, so that
    Adam does not amplify float reordering): loss, parameters, running statistics."""
    import jax
    import optax
    from flax import nnx

    import fleet

    monkeypatch.setitem(sys.modules, "data", data)
    train = _load("cifar10_example_train", EXAMPLE / "train.py")
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 256, (16, 32, 32, 3), dtype=np.uint8),
                rng.integers(0, 10, 16).astype(np.int32), np.arange(16, dtype=np.int32) + 16 * i)
               for i in range(2)]

    def run(step, model, optimizer):
        return [float(step(model, optimizer, x, y, index, 0, 0)) for x, y, index in batches]

    reference = train.ResNet(nnx.Rngs(0))
    want = run(nnx.jit(train.train_step, static_argnums=(5, 6)), reference,
               nnx.Optimizer(reference, optax.sgd(0.05), wrt=nnx.Param))
    make_world(4, fleet.DistributedStrategy(sync_batch_norm=True))
    model = fleet.distributed_model(train.ResNet(nnx.Rngs(0)))
    got = run(fleet.distributed_step(train.train_step), model, fleet.distributed_optimizer(
        nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)))
    flat = {}
    for name, tree in (("want", reference), ("got", model)):
        flat[name] = {jax.tree_util.keystr(p): np.asarray(v) for p, v in
                      jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(tree)))[0]}
    d = max(float(np.max(np.abs(flat["got"][k] - flat["want"][k]))) for k in flat["want"])
    print(f"ResNet, 2 SGD steps, 4 devices: |loss| = {max(abs(a - b) for a, b in zip(got, want)):.1e}"
          f", |parameters and running statistics| = {d:.1e}")
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert d < 1e-5
    assert any("bn1']['mean" in k for k in flat["got"])


@slow  # whole runs of the example (its step is checked in the default tier above)
@pytest.mark.parametrize("flags, says", [
    ([], "resnet; BatchNorm over the global batch"),
    (["--per-replica-bn"], "resnet; BatchNorm per replica")])
def test_the_resnet_example_runs(tmp_path, flags, says):
    """examples/cifar10/train.py --model resnet: global-batch BatchNorm by default,
    per replica when asked; it trains, evaluates in eval mode and writes its metrics."""
    proc = run_script(["--synthetic", "--model", "resnet", *flags, "--train-size", "256",
                       "--test-size", "64", "--epochs", "1", "--batch-size", "16",
                       "--log-freq", "2"], devices=4, cwd=tmp_path, timeout=180)
    assert says in proc.stdout.splitlines()[0] or says in proc.stdout
    metrics = json.loads((tmp_path / "output/cifar10/metrics.json").read_text())
    assert metrics["devices"] == 4 and len(metrics["epochs"]) == 1
    assert 0.0 <= metrics["epochs"][0]["val_accuracy"] <= 1.0


def test_help_shows_the_defaults(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLE / "train.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "(default: 10)" in proc.stdout and "(default: cnn)" in proc.stdout
