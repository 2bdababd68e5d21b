"""``Model.save(path, training=False)`` and ``fleet.load_inference`` (issue 23,
acceptance 2): the network's forward pass as a ``jax.export`` program with its
weights, run in a fresh process that cannot import the model's class, on a batch
size other than any it ran with, equals the model within 1e-6.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from fleet.io import TensorDataset


class ConvNet(nnx.Module):  # BatchNorm (running statistics) and Dropout (random state)
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(4 * 8 * 8, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        return self.head(self.drop(x.reshape(x.shape[0], -1)))


LOAD = textwrap.dedent("""
    import sys
    import numpy as np
    import fleet

    predict = fleet.load_inference(sys.argv[1])
    check = np.load(sys.argv[2])
    out = np.asarray(predict(check["x"]))
    print("PLATFORMS", ",".join(predict.exported.platforms))
    print("DIFF", float(np.abs(out - check["y"]).max()))
""")


def trained_model():
    model = fleet.Model(ConvNet(nnx.Rngs(0)))
    model.prepare(optax.adam(1e-2), optax.softmax_cross_entropy_with_integer_labels)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 3, 32).astype(np.int32)
    model.fit(TensorDataset([x, y]), batch_size=4, epochs=1, verbose=0)  # 16 rows a step
    return model


@pytest.mark.timeout(120)
def test_the_inference_model_runs_in_a_fresh_process_without_the_class(make_world, tmp_path):
    make_world(4, fleet.DistributedStrategy(sync_batch_norm=True))
    model = trained_model()
    model.save(tmp_path / "out" / "infer", training=False)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "infer.jaxexport", "infer.pdiparams"]
    x = np.random.default_rng(1).standard_normal((5, 8, 8, 1)).astype(np.float32)
    model.network.eval()
    np.savez(tmp_path / "check.npz", x=x, y=np.asarray(model.network(x)))
    (tmp_path / "load.py").write_text(LOAD)
    done = subprocess.run([sys.executable, "load.py", str(tmp_path / "out" / "infer"),
                           str(tmp_path / "check.npz")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=90)  # cwd: tests/ (and ConvNet) not importable
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    print(f"batch 5 (trained on 16): |outputs - model| = {lines['DIFF']}")
    assert lines["PLATFORMS"] == "cpu,cuda"
    assert float(lines["DIFF"]) <= 1e-6


@pytest.mark.parametrize("spec", [
    lambda: fleet.static.InputSpec([None, 8, 8, 1], "float32", name="image"),  # the README's
    lambda: jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32),  # its batch axis is not read
])
def test_the_input_shapes_come_from_inputs_or_the_last_batch(make_world, tmp_path, spec):
    make_world(2, fleet.DistributedStrategy(sync_batch_norm=True))
    model = fleet.Model(ConvNet(nnx.Rngs(0)), inputs=[spec()])
    model.save(tmp_path / "given", training=False)  # before any fit: from inputs=
    predict = fleet.load_inference(tmp_path / "given")
    x = np.ones((3, 8, 8, 1), np.float32)
    model.network.eval()
    np.testing.assert_allclose(np.asarray(predict(x)), np.asarray(model.network(x)), atol=1e-6)

    bare = fleet.Model(ConvNet(nnx.Rngs(0)))
    with pytest.raises(fleet.FleetConfigError, match=(
            r"exports the network for a batch of inputs of known shapes.*"
            r"inputs=\[fleet\.static\.InputSpec\(\[None, 784\], 'float32', name='x'\)\]")):
        bare.save(tmp_path / "none", training=False)
    with pytest.raises(fleet.FleetError, match=r"no '.*missing\.jaxexport': pass the path"):
        fleet.load_inference(tmp_path / "missing")


def test_a_program_from_a_newer_jax_names_both_versions(make_world, tmp_path):
    """jax reads the programs of its own version and earlier ones, not later ones
    (jax 0.10.2 cannot read what jax 0.12 exports, measured); the weights file
    records the exporting jax, so fleet says which to use. A program that this jax
    cannot read although its checksum matches (issue 38: checked before it is read)
    is a FleetError whose cause is jax's own error."""
    make_world(1)
    model = fleet.Model(ConvNet(nnx.Rngs(0)),
                        inputs=[fleet.static.InputSpec([None, 8, 8, 1], "float32")])
    model.save(tmp_path / "infer", training=False)
    weights = fleet.load(tmp_path / "infer.pdiparams")
    assert weights["jax"] == jax.__version__
    program = b"a program this jax cannot read"  # intact: its checksum recorded with it
    (tmp_path / "infer.jaxexport").write_bytes(program)
    weights["program"] = {"size": len(program), "crc32": zlib.crc32(program)}
    fleet.save({**weights, "jax": "99.0.0"}, tmp_path / "infer.pdiparams")
    with pytest.raises(fleet.FleetError, match=(
            rf"infer\.jaxexport was exported by jax 99\.0\.0, and this is jax "
            rf"{jax.__version__.replace('.', '[.]')}, which cannot read it .*load it with jax "
            r"99\.0\.0 or later, or save it again here")):
        fleet.load_inference(tmp_path / "infer")
    fleet.save({**weights, "jax": jax.__version__}, tmp_path / "infer.pdiparams")
    with pytest.raises(fleet.FleetError, match=(  # the same version: jax's error, as the cause
            rf"jax {jax.__version__.replace('.', '[.]')} cannot read .*infer\.jaxexport \(\w+"
            r".*\), although it is the file that was saved \(its size and checksum match\)")
                       ) as raised:
        fleet.load_inference(tmp_path / "infer")
    assert "99.0.0" not in str(raised.value)
    assert raised.value.__cause__ is not None
    assert not isinstance(raised.value.__cause__, fleet.FleetError)
