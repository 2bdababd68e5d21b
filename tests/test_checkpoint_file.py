"""Issue 19: the file fleet.save writes (fleet/checkpoint/_file.py): every leaf
type round trips, the file is what its documentation says (read back here by a
reader written from that text alone), writes are atomic, damage of any byte is
caught or harmless, and nothing is unpickled. Checkpoints of earlier fleets:
test_checkpoint_earlier.py."""

import io
import json
import math
import os
import struct
import threading
import zipfile
import zlib
from collections import namedtuple

import jax
import ml_dtypes
import numpy as np
import pytest

from fleet.checkpoint import FleetCheckpointError, load, save

Pair = namedtuple("Pair", ["mu", "nu"])


def every_leaf(world):
    """Every kind of leaf fleet.save takes, and (below) what fleet.load gives back."""
    return {
        "linear": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
                   "bias": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)},
        "count": np.arange(4, dtype=np.int32),
        "zero_d": np.array(3.25),
        "empty_array": np.zeros((0, 3), np.float16),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
        "words": np.array(["a", "bc"]),
        "mask": np.array([True, False]),
        "replicated": jax.device_put(np.arange(4.0, dtype=np.float32), world.replicated),
        "key": jax.random.key(1),
        "np_float": np.float32(0.125), "np_int": np.int64(-9), "np_bool": np.bool_(True),
        "np_complex": np.complex64(1 - 2j), "np_str": np.str_("s"),
        "lr": 0.5, "epoch": 3, "flag": False, "name": "adam", "z": 2 + 3j, "big": 2**70,
        "nan": float("nan"), "inf": float("-inf"), "none": None, "empty": {}, "nothing": [],
        "list": [np.ones(2, np.int8), 7, (2.5, "x")],
        "pair": Pair(mu=np.ones(1, np.float32), nu=None),
        5: "an int key",
    }


EXPECTED = {
    "linear": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
               "bias": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)},
    "count": np.arange(4, dtype=np.int32),
    "zero_d": np.array(3.25),
    "empty_array": np.zeros((0, 3), np.float16),
    "fortran": np.arange(6, dtype=np.int64).reshape(2, 3),
    "words": np.array(["a", "bc"]),
    "mask": np.array([True, False]),
    "replicated": np.arange(4.0, dtype=np.float32),
    "key": np.array([0, 1], np.uint32),
    "np_float": 0.125, "np_int": -9, "np_bool": True, "np_complex": 1 - 2j, "np_str": "s",
    "lr": 0.5, "epoch": 3, "flag": False, "name": "adam", "z": 2 + 3j, "big": 2**70,
    "nan": float("nan"), "inf": float("-inf"), "none": None, "empty": {}, "nothing": [],
    "list": [np.ones(2, np.int8), 7, [2.5, "x"]],
    "pair": {"mu": np.ones(1, np.float32), "nu": None},
    "5": "an int key",
}


def assert_same(got, want, where="value"):
    """Equal values of equal types, arrays bitwise with their dtype and shape."""
    assert type(got) is type(want), f"{where}: {type(got).__name__}, want {type(want).__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert got.tobytes() == np.ascontiguousarray(want).tobytes(), where
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, where


# -- helpers that edit a file at the zip level ----------------------------------------------------

def entries(path) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(path) as z:
        return [(info, z.read(info.filename)) for info in z.infolist()]


def rewrite(path, replace: dict[str, bytes]) -> None:
    """Writes ``path`` again with some entries' bytes replaced (valid zip CRCs)."""
    old = entries(path)
    with zipfile.ZipFile(path, "w") as z:
        for info, data in old:
            z.writestr(info, replace.get(info.filename, data))


def data_span(path, entry: str) -> tuple[int, int]:
    """``(offset, length)`` of an array entry's data, after its .npy header."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(entry)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        n, m = struct.unpack("<26xHH", f.read(30))
        start = info.header_offset + 30 + n + m
        f.seek(start)
        np.lib.format.read_magic(f)
        np.lib.format.read_array_header_1_0(f)
        return f.tell(), info.file_size - (f.tell() - start)


def flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


# -- round trip --------------------------------------------------------------------------------

def test_every_leaf_type_round_trips(make_world, tmp_path):
    world = make_world(2)
    save(every_leaf(world), tmp_path / "all.pdparams")
    assert_same(load(tmp_path / "all.pdparams"), EXPECTED)
    assert sorted(os.listdir(tmp_path)) == ["all.pdparams"]  # one file, no leftovers


def test_a_bare_array_and_a_bare_number(tmp_path):
    save(np.arange(3), tmp_path / "a")
    save(7, tmp_path / "n")
    assert_same(load(tmp_path / "a"), np.arange(3))
    assert_same(load(tmp_path / "n"), 7)


def test_the_file_is_what_its_documentation_says(make_world, tmp_path):
    """A reader written from _file.py's docstring alone reads the same values;
    numpy.load reads the arrays as an .npz; the same state gives the same bytes."""
    world = make_world(2)
    path = tmp_path / "all.pdparams"
    save(every_leaf(world), path)
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        assert infos[-1].filename == "fleet.json"
        assert {i.compress_type for i in infos} == {zipfile.ZIP_STORED}
        assert all(i.date_time == (1980, 1, 1, 0, 0, 0) and not i.flag_bits & 1 for i in infos)

        def no_constants(name):
            raise AssertionError(f"fleet.json holds the non-JSON literal {name}")

        doc = json.loads(z.read("fleet.json").decode("utf-8"), parse_constant=no_constants)
        assert (doc["format"], doc["version"], doc["checksum"]) == ("fleet.save", 1, "crc32")

        def number(v):
            return float(v)  # (a JSON number, or "nan" / "inf" / "-inf")

        def read(node):
            if node is None:
                return None
            if "array" in node:
                raw = z.read(node["array"])
                a = np.load(io.BytesIO(raw), allow_pickle=False)
                if a.dtype.kind == "V":  # a dtype .npy has no name for
                    a = a.view(np.dtype(node["dtype"]))
                assert a.dtype.name == node["dtype"] and list(a.shape) == node["shape"]
                assert not np.isfortran(a) or a.ndim < 2
                assert zlib.crc32(raw[len(raw) - a.nbytes:]) == node["crc32"]
                return a
            (kind, v), = node.items()
            if kind == "dict":
                return {k: read(c) for k, c in v.items()}
            if kind == "list":
                return [read(c) for c in v]
            if kind == "float":
                return number(v)
            if kind == "complex":
                return complex(number(v[0]), number(v[1]))
            return {"str": str, "bool": bool, "int": int}[kind](v)

        assert_same(read(doc["tree"]), EXPECTED)
    npz = np.load(path, allow_pickle=False)
    np.testing.assert_array_equal(npz["linear.kernel"], EXPECTED["linear"]["kernel"])
    np.testing.assert_array_equal(npz["list.0"], EXPECTED["list"][0])
    save(every_leaf(world), tmp_path / "again.pdparams")
    assert (tmp_path / "again.pdparams").read_bytes() == path.read_bytes()


def test_entry_names_are_unique(tmp_path):
    save({"a.b": np.ones(1), "a": {"b": np.zeros(1)}, "A": {"B": np.full(1, 2.0)},
          "x/y": np.ones(2)}, tmp_path / "f")
    with zipfile.ZipFile(tmp_path / "f") as z:
        assert z.namelist() == ["a.b.npy", "a.b~2.npy", "A.B~3.npy", "x_y.npy", "fleet.json"]
    assert_same(load(tmp_path / "f"), {"a.b": np.ones(1), "a": {"b": np.zeros(1)},
                                        "A": {"B": np.full(1, 2.0)}, "x/y": np.ones(2)})


# -- atomic replace ------------------------------------------------------------------------------

def test_a_write_that_fails_midway_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "model.pdparams"
    save({"w": np.arange(3.0), "b": np.ones(2)}, path)
    before = path.read_bytes()
    real = np.lib.format.write_array
    written = []

    def fail_on_the_second(f, array, **kwargs):
        if written:
            f.write(b"half an array")
            raise RuntimeError("the leaf failed midway")
        written.append(array)
        return real(f, array, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", fail_on_the_second)
    with pytest.raises(RuntimeError, match="the leaf failed midway"):
        save({"w": np.zeros(3), "b": np.zeros(2)}, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["model.pdparams"]  # the temporary file is removed
    assert_same(load(path), {"w": np.arange(3.0), "b": np.ones(2)})


def test_a_refused_leaf_writes_nothing(tmp_path):
    path = tmp_path / "model.pdparams"
    save({"w": np.arange(3.0)}, path)
    before = path.read_bytes()
    with pytest.raises(FleetCheckpointError, match=r"\['deep'\]\[1\]\['f'\] is a function; "):
        save({"w": np.zeros(3), "deep": [1, {"f": lambda: 0}]}, path)
    with pytest.raises(FleetCheckpointError, match=r"\['o'\] is an array of object \(objects or "
                                                   r"records\); .*never pickles"):
        save({"o": np.array([object()])}, path)
    with pytest.raises(FleetCheckpointError, match=r"has keys that are the same as strings"):
        save({1: 1, "1": 2}, path)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["model.pdparams"]


def test_concurrent_saves_to_one_path_always_leave_a_complete_file(tmp_path):
    path = tmp_path / "model.pdparams"
    values = [{"w": np.full(20_000, float(i)), "i": i} for i in range(4)]
    save(values[0], path)
    errors = []

    def saver(i):
        try:
            for _ in range(5):
                save(values[i], path)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    loads = 0
    while any(t.is_alive() for t in threads) or not loads:
        got = load(path)  # never a half-written file
        assert_same(got, values[got["i"]])
        loads += 1
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(os.listdir(tmp_path)) == ["model.pdparams"]


# -- damage ---------------------------------------------------------------------------------------

def test_a_flipped_byte_in_an_array_names_it(tmp_path):
    path = tmp_path / "model.pdparams"
    save({"layers": [{"kernel": np.arange(100.0)}, {"kernel": np.arange(50.0)}], "b": np.ones(3)},
         path)
    start, length = data_span(path, "layers.1.kernel.npy")
    flip_byte(path, start + length // 2)
    with pytest.raises(FleetCheckpointError, match=r"(?s)model.pdparams is damaged: 1 array does not "
                                                   r"match the checksum written with it:\n  "
                                                   r"\['layers'\]\[1\]\['kernel'\]: crc32 0x[0-9a-f]{8} "
                                                   r"as read, 0x[0-9a-f]{8} when written$"):
        load(path)
    flip_byte(path, data_span(path, "b.npy")[0])
    with pytest.raises(FleetCheckpointError, match=r"2 arrays do not match .*\n  \['layers'\]\[1\]"
                                                   r"\['kernel'\]: .*\n  \['b'\]: crc32"):
        load(path)


def test_every_flipped_byte_is_caught_or_harmless(tmp_path):
    """A flipped bit anywhere in the file: fleet.load raises FleetCheckpointError,
    or returns exactly what was saved (bytes the zip format does not use)."""
    obj = {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "n": 3, "s": "adam",
           "b": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)}
    path = tmp_path / "model.pdparams"
    save(obj, path)
    good = path.read_bytes()
    harmless = 0
    for offset in range(len(good)):
        path.write_bytes(good)
        flip_byte(path, offset)
        try:
            got = load(path)
        except FleetCheckpointError as e:
            assert str(path) in str(e), e
            continue
        assert_same(got, {"w": obj["w"], "n": 3, "s": "adam", "b": obj["b"]}, f"byte {offset}")
        harmless += 1
    assert harmless < len(good) // 2  # (most bytes matter)


def test_every_cut_short_file_is_refused(tmp_path):
    path = tmp_path / "model.pdparams"
    save({"w": np.arange(40.0), "s": "adam"}, path)
    good = path.read_bytes()
    for length in range(len(good)):
        path.write_bytes(good[:length])
        with pytest.raises(FleetCheckpointError, match=rf"fleet.load: {path} (is damaged|is not a "
                                                       rf"checkpoint written by fleet.save)"):
            load(path)
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(FleetCheckpointError, match=r"model.pdparams is damaged: it begins as a zip "
                                                   r"archive, but its end .* cut short"):
        load(path)


@pytest.mark.parametrize("content, message", [
    (b"", r"is not a checkpoint written by fleet.save \(not a zip archive\)"),
    (bytes(range(256)) * 8, r"is not a checkpoint written by fleet.save \(not a zip archive\)"),
])
def test_garbage_is_not_a_checkpoint(tmp_path, content, message):
    (tmp_path / "junk").write_bytes(content)
    with pytest.raises(FleetCheckpointError, match=rf"fleet.load: .*junk {message}"):
        load(tmp_path / "junk")


def test_a_newer_format_asks_for_a_newer_fleet(tmp_path):
    path = tmp_path / "model.pdparams"
    save({"w": np.ones(2)}, path)
    doc = json.loads(dict((i.filename, d) for i, d in entries(path))["fleet.json"])
    rewrite(path, {"fleet.json": json.dumps(dict(doc, version=2)).encode()})
    with pytest.raises(FleetCheckpointError, match=r"was written by a newer fleet \(format version "
                                                   r"2, this fleet reads up to 1\); upgrade fleet"):
        load(path)


# -- nothing is unpickled -------------------------------------------------------------------------

class _Boom:
    def __reduce__(self):
        return (open, (os.environ["CKPT_PWNED"], "w"))


@pytest.mark.parametrize("json_dtype", ["float64", "object"])
def test_a_planted_pickle_is_never_run(tmp_path, monkeypatch, json_dtype):
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("CKPT_PWNED", str(pwned))
    path = tmp_path / "model.pdparams"
    save({"w": np.ones(1)}, path)
    planted = io.BytesIO()
    np.save(planted, np.array([_Boom()], dtype=object), allow_pickle=True)
    doc = json.loads(dict((i.filename, d) for i, d in entries(path))["fleet.json"])
    doc["tree"]["dict"]["w"]["dtype"] = json_dtype
    rewrite(path, {"w.npy": planted.getvalue(), "fleet.json": json.dumps(doc).encode()})
    with pytest.raises(FleetCheckpointError, match=r"model.pdparams is damaged: \['w'\]: its .npy "
                                                   r"header says object\[1\]"):
        load(path)
    rewrite(path, {"fleet.json": b"\x80\x04" + planted.getvalue()})
    with pytest.raises(FleetCheckpointError, match=r"is damaged: its fleet.json cannot be read"):
        load(path)
    assert not pwned.exists()
