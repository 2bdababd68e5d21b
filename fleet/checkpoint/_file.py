"""The file ``fleet.save`` writes: a zip of ``.npy`` arrays and one JSON tree.

A reader needs a zip reader, a JSON parser and NumPy's ``.npy`` format, nothing
else; nothing in the file is executed or unpickled.

The file is a ZIP archive (PKWARE's APPNOTE; ZIP64 records where an entry or the
archive passes 4 GiB) whose entries are all *stored*: compression method 0, not
encrypted, so an array's bytes lie in the file as they lie in memory. fleet
writes the entries in this order (a reader finds them in the zip's central
directory, in any order), each dated 1980-01-01 00:00 so that the same state
gives the same bytes:

* one entry per array, in NumPy's ``.npy`` format (format version 1.0, or 2.0
  for a header over 64 KiB), C order (``'fortran_order': False``), never an
  object or structured dtype. Its name is the array's dotted path with
  ``.npy`` added (``linear1.kernel.npy``; ``/`` and ``\\`` become ``_``,
  ``~2``, ``~3``... make names unique), for people and for ``numpy.load``,
  which opens the file as an ``.npz``; a reader finds arrays through
  ``fleet.json``, never by their names;
* ``fleet.json``, last: UTF-8, strict JSON (no ``NaN`` / ``Infinity``)::

      {"format": "fleet.save", "version": 1, "checksum": "crc32", "tree": NODE}

  ``checksum`` is ``null`` when the file was written without checksums (only
  ``benchmarks/checkpoint_io.py`` does, to time them).

``NODE`` is one of (what ``fleet.load`` returns for it):

* ``null``: ``None``;
* ``{"dict": {"key": NODE, ...}}``: a dict, its keys in this order;
* ``{"list": [NODE, ...]}``: a list;
* ``{"str": "adam"}``, ``{"bool": true}``, ``{"int": 3}`` (any size):
  a str, a bool, an int;
* ``{"float": 0.5}``: a float; ``"nan"``, ``"inf"`` and ``"-inf"`` stand for
  those values, a number for any other (it reads back to the same float);
* ``{"complex": [RE, IM]}``: a complex, each part as a float's value;
* ``{"array": "w.npy", "dtype": "float32", "shape": [2, 3], "crc32": 12345}``:
  a numpy array, the entry named. ``dtype`` is NumPy's name of the dtype
  (``dtype.name``: ``"float32"``, ``"bool"``, ``"int8"``, ``"bfloat16"``); the
  ``.npy`` header has that dtype and ``shape``, except for the dtypes ``.npy``
  has no name for (ml_dtypes' ``bfloat16``, ``float8_*``, ``int4``...): there
  it says ``'<V2'`` (raw items of the dtype's size) and the data are that
  dtype's bytes. ``crc32`` is zlib's CRC-32 (an unsigned 32-bit integer) of the
  array's data in C order, the entry's bytes after the ``.npy`` header; absent
  when ``checksum`` is ``null``.

What ``fleet.save`` maps to these: dicts, and pytree nodes with named children
(dataclasses, namedtuples such as optax's states) to ``dict`` (keys as
``str``); lists, tuples and pytree nodes with unnamed children to ``list``; a
pytree node without children to ``null``; numpy scalars to ``bool``, ``int``,
``float``, ``complex`` or ``str`` (they load as Python values); jax arrays to
``array`` (their values, PRNG keys as their key data).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import struct
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

import jax
import numpy as np

from fleet.checkpoint import _integrity
from fleet.checkpoint._errors import FleetCheckpointError, first_line
from fleet.runtime._leaves import dotted

FORMAT = "fleet.save"
VERSION = 1
JSON_ENTRY = "fleet.json"
_DATE = (1980, 1, 1, 0, 0, 0)
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_EXTENSION_DTYPE = re.compile(r"[a-z][a-z0-9_]*")
_SUMMER = ThreadPoolExecutor(1, thread_name_prefix="fleet-save-checksums")  # beside the write
_KEYED = (jax.tree_util.DictKey, jax.tree_util.GetAttrKey)


@dataclasses.dataclass
class Tree:
    """A tree ready to write: its ``fleet.json`` node and its arrays by entry name."""

    node: Any = None
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    nodes: dict[str, dict] = dataclasses.field(default_factory=dict)  # (filled with crc32)
    names: set[str] = dataclasses.field(default_factory=set)

    def add(self, path: tuple, value: np.ndarray) -> dict:
        base = (dotted(path) or "value").replace("/", "_").replace("\\", "_")
        name, n = base, 1
        while name.lower() in self.names:  # (unique on case-insensitive disks too)
            n += 1
            name = f"{base}~{n}"
        self.names.add(name.lower())
        entry = f"{name}.npy"
        self.arrays[entry] = value if value.flags.c_contiguous else value.copy(order="C")
        node = self.nodes[entry] = {"array": entry, "dtype": value.dtype.name,
                                    "shape": list(value.shape)}
        return node


def encode(obj: Any, host_leaf: Any) -> Tree:
    """``obj`` as a :class:`Tree`; ``host_leaf(path, leaf)`` gives each leaf as a
    numpy array or a Python ``bool`` / ``int`` / ``float`` / ``complex`` / ``str``
    (or raises for what cannot be saved)."""
    tree = Tree()
    tree.node = _encode(obj, (), host_leaf, tree)
    return tree


def _encode(x: Any, path: tuple, host_leaf: Any, tree: Tree) -> Any:
    if x is None:
        return None
    if isinstance(x, dict):
        keys = [str(k) for k in x]
        if len(set(keys)) < len(keys):
            raise FleetCheckpointError(
                f"fleet.save: {jax.tree_util.keystr(path) or 'the object'} has keys that are "
                f"the same as strings ({sorted(x, key=str)}); fleet.save writes dict keys as "
                "strings: rename them")
        return {"dict": {str(k): _encode(v, path + (jax.tree_util.DictKey(k),), host_leaf, tree)
                         for k, v in x.items()}}
    if type(x) in (list, tuple):
        return {"list": [_encode(v, path + (jax.tree_util.SequenceKey(i),), host_leaf, tree)
                         for i, v in enumerate(x)]}
    children = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
    if children and children[0][0] == ():  # a leaf
        return _leaf(host_leaf(path, x), path, tree)
    if not children:
        return None
    if all(isinstance(p[0], _KEYED) for p, _ in children):
        return {"dict": {dotted(p): _encode(v, path + p, host_leaf, tree) for p, v in children}}
    return {"list": [_encode(v, path + p, host_leaf, tree) for p, v in children]}


def _leaf(v: Any, path: tuple, tree: Tree) -> dict:
    if isinstance(v, np.ndarray):
        return tree.add(path, v)
    if isinstance(v, bool):
        return {"bool": bool(v)}
    if isinstance(v, int):
        return {"int": int(v)}
    if isinstance(v, float):
        return {"float": _number(v)}
    if isinstance(v, complex):
        return {"complex": [_number(v.real), _number(v.imag)]}
    return {"str": str(v)}


def _number(v: float) -> float | str:
    v = float(v)
    return v if math.isfinite(v) else str(v)  # "nan", "inf", "-inf"


def write(f: BinaryIO, tree: Tree) -> None:
    """Writes ``tree`` into ``f``, ``fleet.save``'s temporary file, new and opened
    ``"wb"`` (the caller flushes it to disk)."""
    summing = _SUMMER.submit(_integrity.checksums, tree.arrays)
    try:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
            for entry, value in tree.arrays.items():
                info = _info(entry)
                info.file_size = value.nbytes + 4096  # (an upper bound: ZIP64 or not)
                with z.open(info, "w") as out:
                    np.lib.format.write_array(out, value, allow_pickle=False)
            for entry, crc in summing.result().items():
                tree.nodes[entry]["crc32"] = next(iter(crc.values()))
            doc = {"format": FORMAT, "version": VERSION,
                   "checksum": _integrity.ALGORITHM if _integrity.ENABLED else None,
                   "tree": tree.node}
            z.writestr(_info(JSON_ENTRY), json.dumps(doc, allow_nan=False))
    finally:
        summing.cancel()


def _info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_DATE)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    return info


# --------------------------------------------------------------------------- reading

class NotFleetFile(Exception):
    """The file is not one ``fleet.save`` wrote (the reason is the message)."""


class Damaged(Exception):
    """The file is a ``fleet.save`` file that cannot be read as written."""


class Newer(Exception):
    """The file was written in a newer version of the format."""


def read_doc(f: Any) -> tuple[zipfile.ZipFile, dict]:
    """The open zip and its ``fleet.json`` of the file ``f`` (opened ``"rb"``)."""
    head = f.read(4)
    f.seek(0)
    try:
        z = zipfile.ZipFile(f)
    except Exception as e:  # noqa: BLE001 (what zipfile raises on damaged bytes varies)
        if head == b"PK\x03\x04":
            raise Damaged(f"it begins as a zip archive, but its end (the zip's directory) is "
                          f"missing or unreadable: it was cut short or overwritten ({first_line(e)})"
                          ) from None
        raise NotFleetFile("not a zip archive") from None
    if JSON_ENTRY not in z.namelist():
        raise NotFleetFile(f"a zip archive without {JSON_ENTRY}")
    try:
        doc = json.loads(z.read(JSON_ENTRY).decode("utf-8"))
    except Exception as e:  # noqa: BLE001 (a bad zip CRC, bad JSON, a seek out of the file...)
        raise Damaged(f"its {JSON_ENTRY} cannot be read ({first_line(e)})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        name = doc.get("format") if isinstance(doc, dict) else None
        raise NotFleetFile(f"its {JSON_ENTRY} names the format {name!r}, not {FORMAT!r}")
    if not isinstance(doc.get("version"), int) or doc["version"] > VERSION:
        raise Newer(f"format version {doc.get('version')!r}, this fleet reads up to {VERSION}")
    return z, doc


def read(path: str) -> tuple[Any, dict[str, int], dict[str, np.ndarray]]:
    """``(value, {name: crc32}, {name: array})`` of the file ``path``: the arrays
    by their paths (``keystr``), for the caller to verify."""
    with open(path, "rb") as f:
        z, doc = read_doc(f)
        sums: dict[str, int] = {}
        arrays: dict[str, np.ndarray] = {}
        try:
            value = _decode(doc.get("tree"), (), lambda node, path: _array(f, z, node, path,
                                                                           sums, arrays))
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
            raise Damaged(f"its {JSON_ENTRY} does not describe a tree ({type(e).__name__}: "
                          f"{e})") from None
    lost = [k for k in arrays if k not in sums]
    if doc.get("checksum") is not None and lost:  # (written with a crc32 for every array)
        raise Damaged(f"its {JSON_ENTRY} says every array has a checksum "
                      f"({doc['checksum']}), but {len(lost)} ha{'ve' if len(lost) > 1 else 's'} "
                      f"none: {', '.join(lost[:5])}{', ...' if len(lost) > 5 else ''}")
    return value, sums, arrays


def _decode(node: Any, path: tuple, array: Any) -> Any:
    if node is None:
        return None
    (kind, v), = node.items() if "array" not in node else [("array", node)]
    if kind == "dict":
        return {k: _decode(c, path + (jax.tree_util.DictKey(k),), array) for k, c in v.items()}
    if kind == "list":
        return [_decode(c, path + (jax.tree_util.SequenceKey(i),), array) for i, c in enumerate(v)]
    if kind == "array":
        return array(v, path)
    if kind == "float":
        return float(v)
    if kind == "complex":
        return complex(float(v[0]), float(v[1]))
    types = {"str": str, "bool": bool, "int": int}
    if not isinstance(v, types[kind]):
        raise TypeError(f"{kind} node holds {v!r}")
    return v


def _array(f: Any, z: zipfile.ZipFile, node: dict, path: tuple, sums: dict, arrays: dict) -> Any:
    key = jax.tree_util.keystr(path) or "the array"
    entry = node["array"]
    try:
        info = z.getinfo(entry)
    except KeyError:
        raise Damaged(f"{key}: its entry {entry!r} is missing") from None
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 1:
        raise Damaged(f"{key}: its entry {entry!r} is compressed or encrypted")
    try:
        f.seek(info.header_offset)
        local = f.read(_LOCAL_HEADER.size)
        if len(local) < _LOCAL_HEADER.size or _LOCAL_HEADER.unpack(local)[0] != b"PK\x03\x04":
            raise Damaged(f"{key}: the zip header of its entry {entry!r} is missing")
        start = info.header_offset + _LOCAL_HEADER.size + sum(_LOCAL_HEADER.unpack(local)[1:])
        f.seek(start)
        version = np.lib.format.read_magic(f)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, fortran, dtype = read_header(f)  # (a literal; never unpickles)
    except Damaged:
        raise
    except Exception as e:  # noqa: BLE001 (what numpy raises on a damaged header varies)
        raise Damaged(f"{key}: its .npy header cannot be read ({first_line(e)})") from None
    dtype, shape = _dtype(dtype, node["dtype"], key), tuple(shape)
    if (dtype.name != node["dtype"] or dtype.hasobject or dtype.fields is not None
            or list(shape) != node["shape"]):
        raise Damaged(f"{key}: its .npy header says {dtype.name}{list(shape)}, {JSON_ENTRY} "
                      f"says {node['dtype']}{node['shape']}")
    count = math.prod(shape)
    if f.tell() - start + count * dtype.itemsize != info.file_size:
        raise Damaged(f"{key}: its entry {entry!r} holds {info.file_size} bytes, not the "
                      f"{count * dtype.itemsize} of a {node['dtype']}{node['shape']} array")
    data = np.fromfile(f, dtype=dtype, count=count)
    if data.size != count:
        raise Damaged(f"{key}: its data are cut short ({data.size} of {count} items)")
    value = data.reshape(shape[::-1]).T if fortran else data.reshape(shape)
    arrays[key] = value
    if "crc32" in node:
        sums[key] = int(node["crc32"])
    return value


def _dtype(header: np.dtype, name: str, key: str) -> np.dtype:
    """The dtype of an array whose ``.npy`` header says ``header`` and
    ``fleet.json`` says ``name``: an extension dtype (``bfloat16``) from raw items."""
    if header.name == name or header.kind != "V" or header.fields is not None:
        return header  # (a mismatch is the caller's to report)
    if not isinstance(name, str) or not _EXTENSION_DTYPE.fullmatch(name):
        raise Damaged(f"{key}: {JSON_ENTRY} names the dtype {name!r}")
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise Damaged(f"{key}: it is a {name} array, a dtype this Python does not have "
                      "(import ml_dtypes, or the library that defines it)") from None
    if dtype.hasobject or dtype.fields is not None or dtype.itemsize != header.itemsize:
        raise Damaged(f"{key}: {JSON_ENTRY} names the dtype {name!r} for {header.itemsize}-byte "
                      "items")
    return dtype
