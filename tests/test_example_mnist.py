"""examples/mnist: the IDX reader, the script on one process and through fleetrun,
and the Fashion-MNIST accuracy on 1 and 4 CPU devices (the one long test).
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import jobs
from tests.tiers import slow

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mnist"
FASHION = Path("/usr/share/datasets/fashion-mnist")


def require_fashion_mnist() -> None:
    """Skips the test where the Debian package is missing (fails it on CI)."""
    if not (FASHION / "t10k-labels-idx1-ubyte.gz").exists():
        reason = (f"Fashion-MNIST is not installed in {FASHION}: "
                  "apt-get install -y dataset-fashion-mnist")
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run this test: {reason}")
        pytest.skip(reason)


def _load_data_module():
    spec = importlib.util.spec_from_file_location("mnist_example_data", EXAMPLE / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


data = _load_data_module()


def run(args, devices=1, cwd=None, timeout=180, check=True):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(EXAMPLE / "train.py"), *args], env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def small_idx(tmp_path_factory):
    """A learnable MNIST-format data set: 10 classes, each a bright 7x7 block."""
    root = tmp_path_factory.mktemp("idx")
    rng = np.random.RandomState(0)
    for split, n in (("train", 512), ("test", 100)):
        labels = rng.randint(0, 10, n).astype(np.uint8)
        images = rng.randint(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(labels):
            r, col = divmod(int(c), 4)
            images[i, 7 * r:7 * r + 7, 7 * col:7 * col + 7] += 150
        img_name, lab_name = data.FILES[split]
        data.write_idx(root / f"{img_name}.gz", images)  # gzipped, as Debian ships them
        data.write_idx(root / lab_name, labels)  # and plain
    return root


# -- the IDX reader ------------------------------------------------------------------------

def test_idx_reader_reads_what_was_written(small_idx, tmp_path):
    images, labels = data.load(small_idx, "train")
    assert images.shape == (512, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (512,) and labels.max() == 9
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    data.write_idx(tmp_path / "a.gz", array)
    np.testing.assert_array_equal(data.read_idx(tmp_path / "a.gz"), array)


def test_idx_reader_errors(tmp_path):
    (tmp_path / "bad").write_bytes(b"PK\x03\x04rest")
    with pytest.raises(data.DataError, match=r"not an IDX file \(magic bytes 504b0304"):
        data.read_idx(tmp_path / "bad")
    data.write_idx(tmp_path / "cut", np.zeros((4, 5), np.uint8))
    (tmp_path / "cut").write_bytes((tmp_path / "cut").read_bytes()[:-3])
    with pytest.raises(data.DataError, match=r"holds 17 data bytes, but its header \(4, 5\) "
                                             r"says 20"):
        data.read_idx(tmp_path / "cut")
    with pytest.raises(data.DataError, match=r"no train-images-idx3-ubyte\[\.gz\] in .*"
                                             r"--data-dir DIR.*dataset-fashion-mnist"):
        data.load(tmp_path, "train")


def test_script_without_data_says_what_to_pass(tmp_path):
    proc = run(["--data-dir", str(tmp_path)], check=False, timeout=60)
    assert proc.returncode == 1
    assert "error: no train-images-idx3-ubyte[.gz] in" in proc.stderr
    assert "--data-dir DIR" in proc.stderr


def test_defaults_are_the_seeds_settings(monkeypatch):
    """Seed 003: batch 32, 5 epochs, Adam, Flatten-Linear(784, 512)-ReLU-Dropout(0.2)-
    Linear(512, 10). (The other tests pass smaller settings, to stay fast.)"""
    monkeypatch.setitem(sys.modules, "data", data)  # what train.py imports as `data`
    spec = importlib.util.spec_from_file_location("mnist_example_train", EXAMPLE / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    args = train.parse_args([])
    assert (args.batch_size, args.epochs, args.lr) == (32, 5, 1e-3)
    from flax import nnx

    net = train.MLP(nnx.Rngs(0))
    assert net.linear1.kernel.shape == (784, 512) and net.linear2.kernel.shape == (512, 10)
    assert net.dropout.rate == 0.2
    x = np.ones((3, 28, 28), np.float32)
    want = nnx.relu(x.reshape(3, 784) @ net.linear1.kernel[...] + net.linear1.bias[...])
    want = want @ net.linear2.kernel[...] + net.linear2.bias[...]
    net.eval()  # dropout off: Linear-ReLU-Linear
    np.testing.assert_allclose(net(x), want, rtol=1e-5, atol=1e-5)
    source = (EXAMPLE / "train.py").read_text()
    assert "optax.adam(args.lr)" in source


# -- acceptance 1: one process and fleetrun --------------------------------------------------

@slow
def test_runs_on_one_process_and_through_fleetrun_alike(small_idx, tmp_path):
    """Two replicas either way (1 process x 2 devices, 2 processes x 1 device): the same
    global batches and the same per-replica dropout keys, so the same model."""
    args = ["--data-dir", str(small_idx), "--epochs", "2", "--batch-size", "16",
            "--log-freq", "8", "--verbose", "2"]
    single = run([*args, "--metrics-out", str(tmp_path / "single.json")], devices=2)
    assert "test accuracy:" in single.stdout and "samples/s" in single.stdout
    assert "images, 2 devices, 1 process)" in single.stdout  # not "1 processes" (issue 38)
    # Paddle's console (issue 23): its opening line, Epoch N/M, steps with ms/step
    lines = single.stdout.splitlines()
    assert lines.count("The loss value printed in the log is the current step, and the "
                       "metric is the average value of previous steps.") == 1
    assert "Epoch 1/2" in lines and "Epoch 2/2" in lines
    steps = [line for line in lines if line.startswith("step ")]
    assert steps and all(re.fullmatch(r"step +\d+/\d+ - loss: \d\.\d{4} - acc: \d\.\d{4} - "
                                      r"\d+(s|ms|us)/step( - \d+ samples/s)?", line)
                         for line in steps), steps

    job = jobs.two_processes(tmp_path, EXAMPLE / "train.py", *args, "--metrics-out",
                             str(tmp_path / "fleetrun.json"), devices=1)
    assert re.search(r"^test accuracy:", job.output, re.M)  # rank 0's lines, unprefixed
    assert "test accuracy" not in job.log(1)

    a = json.loads((tmp_path / "single.json").read_text())
    b = json.loads((tmp_path / "fleetrun.json").read_text())
    assert (a["devices"], a["processes"], b["devices"], b["processes"]) == (2, 1, 2, 2)
    assert a["global_batch"] == b["global_batch"] == 32
    assert a["acc"] == b["acc"] > 0.9  # the blocks are easy to learn
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)


# -- acceptance 3: Fashion-MNIST -------------------------------------------------------------

@slow
def test_fashion_mnist_one_epoch_on_4_devices_reaches_84_percent(tmp_path):
    require_fashion_mnist()
    results = {}
    # The same global batch of 64 on both, and no dropout: the replicas draw their own
    # dropout masks, so only without it do 4 devices train the single-device model.
    for devices in (4, 1):
        out = tmp_path / f"{devices}.json"
        run(["--dataset", "fashion", "--epochs", "1", "--batch-size", str(64 // devices),
             "--dropout", "0", "--verbose", "0", "--metrics-out", str(out)],
            devices=devices, timeout=300)
        results[devices] = json.loads(out.read_text())
        assert results[devices]["devices"] == devices and results[devices]["test_images"] == 10000
    print({d: r["acc"] for d, r in results.items()})
    assert results[4]["acc"] >= 0.84
    assert abs(results[4]["acc"] - results[1]["acc"]) <= 0.005
