"""Bad inputs to ``fleet.load_inference`` (issue 38, rows 3-5): a program cut
short or with bytes changed is refused by its checksum before jax reads a byte
of it (none loads); another model's weights, or weights whose shapes changed,
are refused naming the weight and both shapes; a pair exported before fleet
recorded the checksum still loads, unchecked, and says so.
"""

from __future__ import annotations

import shutil
import warnings
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

import fleet

X = np.linspace(-1, 1, 15, dtype=np.float32).reshape(5, 3)


class Net(nnx.Module):
    def __init__(self, hidden=4):
        rngs = nnx.Rngs(0)
        self.a = nnx.Linear(3, hidden, rngs=rngs)
        self.b = nnx.Linear(hidden, 2, rngs=rngs)

    def __call__(self, x):
        return self.b(nnx.relu(self.a(x)))


def export(path, hidden=4):
    """Exports a small network to ``path``; its outputs on :data:`X`."""
    model = fleet.Model(Net(hidden), inputs=[fleet.static.InputSpec([None, 3], "float32")])
    model.save(path, training=False)
    model.network.eval()
    return np.asarray(model.network(X))


@pytest.fixture
def saved(make_world, tmp_path, monkeypatch):
    """A saved pair ``(path, expected outputs, the program's bytes)``, and a count of
    jax's deserializations (``reads[0]``)."""
    make_world(1)
    path = tmp_path / "infer"
    expected = export(path)
    reads = [0]
    deserialize = jax.export.deserialize

    def counted(blob):
        reads[0] += 1
        return deserialize(blob)

    monkeypatch.setattr(jax.export, "deserialize", counted)
    return path, expected, (tmp_path / "infer.jaxexport").read_bytes(), reads


def test_an_intact_pair_loads_checked_and_equals_the_model(saved):
    path, expected, program, reads = saved
    record = fleet.load(f"{path}.pdiparams")["program"]
    assert record == {"size": len(program), "crc32": zlib.crc32(program)}
    predict = fleet.load_inference(path)  # (a FleetWarning would fail here: none is raised)
    np.testing.assert_allclose(np.asarray(predict(X)), expected, atol=1e-6)
    assert reads[0] == 1


def test_a_program_cut_short_is_refused_before_jax_reads_it(saved):
    path, _, program, reads = saved
    n = len(program)
    for cut in (0, 1, 4, 16, 64, n // 3, n // 2, n - 8, n - 1):
        (path.parent / "infer.jaxexport").write_bytes(program[:cut])
        with pytest.raises(fleet.FleetCheckpointError, match=(
                rf"infer\.jaxexport is not the program that .*infer\.pdiparams was saved with: "
                rf"it has {cut} bytes, crc32 0x[0-9a-f]{{8}}, and .*infer\.pdiparams recorded "
                rf"{n} bytes, crc32 {zlib.crc32(program):#010x}\. It is shorter than saved: it "
                r"was cut short .*Nothing was loaded: copy both files again .*or export again "
                r"with Model\.save\(path, training=False\)")):
            fleet.load_inference(path)
    print(f"program of {n} bytes: cut at 9 offsets, 9 refused by the checksum")
    assert reads[0] == 0


def test_every_flipped_byte_is_refused_by_the_checksum(saved):
    """Before the checksum, 4 of 8 flips measured raised the struct module's error
    and 4 changed bytes jax never reads (they loaded). Bytes at 64 offsets spread
    over the program (its first and last among them), each flipped whole and in
    its lowest bit, are all refused; none is deserialized. (Every byte: 26 s.)"""
    path, expected, program, reads = saved
    refused = 0
    offsets = np.unique(np.linspace(0, len(program) - 1, 64).astype(int))
    for offset in offsets:
        for mask in (0xFF, 0x01):
            damaged = bytearray(program)
            damaged[offset] ^= mask
            (path.parent / "infer.jaxexport").write_bytes(bytes(damaged))
            with pytest.raises(fleet.FleetCheckpointError, match=(
                    r"infer\.jaxexport is not the program .* Its bytes changed after it was "
                    r"saved \(on disk or in transfer\)")):
                fleet.load_inference(path)
            refused += 1
    print(f"program of {len(program)} bytes: {refused} flips, {refused} refused, "
          f"{reads[0]} deserialized")
    assert refused == 2 * len(offsets) == 128 and reads[0] == 0
    (path.parent / "infer.jaxexport").write_bytes(program)  # put back: it loads again
    np.testing.assert_allclose(np.asarray(fleet.load_inference(path)(X)), expected, atol=1e-6)


def test_another_models_weights_file_is_refused(saved, tmp_path):
    """A whole .pdiparams copied from another export: its record names another
    program, so the pair is refused before jax reads the program."""
    path, _, program, reads = saved
    export(tmp_path / "other", hidden=5)
    shutil.copy(tmp_path / "other.pdiparams", tmp_path / "infer.pdiparams")
    with pytest.raises(fleet.FleetCheckpointError, match=(
            r"infer\.jaxexport is not the program that .*infer\.pdiparams was saved with: .*"
            r"it comes from another save than the \.pdiparams\. Nothing was loaded")):
        fleet.load_inference(path)
    assert reads[0] == 0


def test_another_models_weights_are_refused_naming_the_weight_and_both_shapes(saved, tmp_path):
    """Another model's names and weights under this program's record (written with
    fleet.save): the program is intact, the weights do not fit it."""
    path, _, _, _ = saved
    export(tmp_path / "other", hidden=5)
    mine, other = fleet.load(f"{path}.pdiparams"), fleet.load(tmp_path / "other.pdiparams")
    fleet.save({**mine, "names": other["names"], "weights": other["weights"]},
               f"{path}.pdiparams")
    with pytest.raises(fleet.FleetCheckpointError, match=(
            r"the weights in .*infer\.pdiparams do not fit the program .*infer\.jaxexport \("
            r"'a\.bias\.value': float32\[5\] in the weights, float32\[4\] in the program; "
            r"'a\.kernel\.value': float32\[3, 5\] in the weights, float32\[3, 4\] in the program; "
            r"'b\.kernel\.value': float32\[5, 2\] in the weights, float32\[4, 2\] in the program\): "
            r"they are another model's weights.*Pass the \.pdiparams saved with this program")):
        fleet.load_inference(path)


@pytest.mark.parametrize("change, found", [
    (lambda w: {**w, "weights": [w["weights"][0], np.zeros((3, 6), np.float32),
                                 *w["weights"][2:]]},
     r"'a\.kernel\.value': float32\[3, 6\] in the weights, float32\[3, 4\] in the program"),
    (lambda w: {**w, "weights": [w["weights"][0].astype(np.float16), *w["weights"][1:]]},
     r"'a\.bias\.value': float16\[4\] in the weights, float32\[4\] in the program"),
    (lambda w: {**w, "names": w["names"][:3], "weights": w["weights"][:3]},
     r"the program takes 4 weights, .*infer\.pdiparams holds 3"),
], ids=["shape", "dtype", "count"])
def test_changed_weights_are_refused_naming_what_changed(saved, change, found):
    path, _, _, _ = saved
    weights = fleet.load(f"{path}.pdiparams")
    assert weights["names"] == ["a.bias.value", "a.kernel.value", "b.bias.value",
                                "b.kernel.value"]
    fleet.save(change(weights), f"{path}.pdiparams")
    with pytest.raises(fleet.FleetCheckpointError, match=(
            rf"do not fit the program .*infer\.jaxexport \({found}\): they are another model's "
            r"weights, or were changed after saving")):
        fleet.load_inference(path)


def as_before_issue_38(path):
    """Rewrites the pair as fleet wrote it before it recorded the program's checksum
    (the same .jaxexport bytes; a .pdiparams of names, weights and jax)."""
    weights = fleet.load(f"{path}.pdiparams")
    fleet.save({k: weights[k] for k in ("names", "weights", "jax")}, f"{path}.pdiparams")


def test_a_pair_exported_before_the_checksum_loads_unchecked_and_says_so(saved, tmp_path):
    path, expected, program, _ = saved
    as_before_issue_38(path)
    with pytest.warns(fleet.FleetWarning, match=(
            r"infer\.jaxexport has no checksum .* so it is loaded unchecked.*Export it again "
            r"with Model\.save\(path, training=False\) to add one")):
        predict = fleet.load_inference(path)
    np.testing.assert_allclose(np.asarray(predict(X)), expected, atol=1e-6)
    with warnings.catch_warnings(record=True) as seen:  # Python's default filter: once
        warnings.simplefilter("default")
        for _ in range(3):
            fleet.load_inference(path)
    assert [w.category for w in seen] == [fleet.FleetWarning]

    (tmp_path / "infer.jaxexport").write_bytes(program[:len(program) // 2])
    with warnings.catch_warnings(), pytest.raises(fleet.FleetCheckpointError, match=(
            r"jax cannot read .*infer\.jaxexport \(\w+: .*\); it has no checksum \(exported "
            r"before fleet recorded one\), so it is most likely damaged")) as raised:
        warnings.simplefilter("ignore", fleet.FleetWarning)
        fleet.load_inference(path)
    assert raised.value.__cause__ is not None  # jax's (or the struct module's) own error

    export(tmp_path / "other", hidden=5)  # unchecked, another model's weights still refused
    (tmp_path / "infer.jaxexport").write_bytes(program)
    shutil.copy(tmp_path / "other.pdiparams", tmp_path / "infer.pdiparams")
    as_before_issue_38(path)
    with warnings.catch_warnings(), pytest.raises(fleet.FleetCheckpointError, match=(
            r"'a\.kernel\.value': float32\[3, 5\] in the weights, float32\[3, 4\] in the program")):
        warnings.simplefilter("ignore", fleet.FleetWarning)
        fleet.load_inference(path)


def test_a_weights_file_of_another_kind_is_refused(saved):
    path, _, _, _ = saved
    weights = fleet.load(f"{path}.pdiparams")
    fleet.save({**weights, "program": {"size": "3752"}}, f"{path}.pdiparams")
    with pytest.raises(fleet.FleetCheckpointError, match=(
            r"infer\.pdiparams is damaged: its 'program' entry is \{'size': '3752'\}, not "
            r"\{'size': int, 'crc32': int\}")):
        fleet.load_inference(path)
    fleet.save({"a.kernel": weights["weights"][1]}, f"{path}.pdiparams")  # a training .pdparams
    with pytest.raises(fleet.FleetCheckpointError, match=(
            r"infer\.pdiparams holds \['a\.kernel'\], not the inference weights Model\.save\("
            r"path, training=False\) writes .*a \.pdparams file saved for training")):
        fleet.load_inference(path)


@pytest.mark.parametrize("given, found", [
    (np.ones((5, 4), np.float32), r"given float32\[5, 4\]"),
    (np.ones((5, 3), np.float64), r"given float64\[5, 3\]"),
    (np.ones((3,), np.float32), r"given float32\[3\]"),
])
def test_inputs_the_program_does_not_take_are_named_at_the_call(saved, given, found):
    """A loaded program called with another shape, dtype or rank than it was saved
    for: fleet's error (input 1, its shape with the batch named, what was given),
    not jax's Shape mismatch; any batch size still runs."""
    path, expected, _, _ = saved
    predict = fleet.load_inference(path)
    with pytest.raises(fleet.FleetError, match=r"input 1 of the program .*infer\.jaxexport "
                       r"must be float32\[.*, 3\] \(a named dimension takes any size\), "
                       + found):
        predict(given)
    with pytest.raises(fleet.FleetError, match=r"takes 1 input\(s\) \(float32\[.*, 3\]\), "
                                               r"given 2"):
        predict(X, X)
    np.testing.assert_allclose(np.asarray(predict(X[:2])), expected[:2], atol=1e-6)
