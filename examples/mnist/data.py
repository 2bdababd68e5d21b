"""MNIST-format IDX files (MNIST, Fashion-MNIST): the reader and where to find them.

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of
dimensions), one big-endian uint32 per dimension, then the data. Files may be
gzipped (``train-images-idx3-ubyte.gz``), as Debian's ``dataset-fashion-mnist``
ships them in ``/usr/share/datasets/fashion-mnist``.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

FASHION_DIR = "/usr/share/datasets/fashion-mnist"
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class DataError(Exception):
    """The data set is missing or malformed; the message says what to do."""


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """The array stored in one IDX file (``.gz`` or not)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _TYPES:
        raise DataError(f"{path} is not an IDX file (magic bytes {raw[:4].hex()}, expected "
                        "00 00 <type> <ndim>)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(raw[4:header], ">u4"))
    dtype = np.dtype(_TYPES[raw[2]])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(f"{path} holds {len(raw) - header} data bytes, but its header "
                        f"{shape} says {expected}; the file is truncated or corrupt")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _find(data_dir: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (data_dir / name).exists():
            return data_dir / name
    raise DataError(
        f"no {stem}[.gz] in {data_dir}. Put the four MNIST-format IDX files "
        f"({', '.join(n for pair in FILES.values() for n in pair)}, gzipped or not) in a "
        "directory and pass --data-dir DIR, or install Fashion-MNIST from Debian "
        "(apt-get install dataset-fashion-mnist) and pass --dataset fashion"
    )


def load(data_dir: str | os.PathLike, split: str) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 (N, 28, 28), labels uint8 (N,))`` of ``split`` ('train'/'test')."""
    data_dir = Path(data_dir)
    images_name, labels_name = FILES[split]
    images, labels = read_idx(_find(data_dir, images_name)), read_idx(_find(data_dir, labels_name))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise DataError(f"{data_dir}: {split} images {images.shape} and labels {labels.shape} "
                        "do not match; expected (N, rows, cols) and (N,)")
    return images, labels


def default_dir(dataset: str) -> str | None:
    """Where ``--dataset`` lives when ``--data-dir`` is not given."""
    if dataset == "fashion" and os.path.isdir(FASHION_DIR):
        return FASHION_DIR
    return None


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Writes ``array`` (uint8) as an IDX file, gzipped when ``path`` ends in ``.gz``
    (for tests and small local data sets)."""
    array = np.ascontiguousarray(array, np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())
