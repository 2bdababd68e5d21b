"""Checksums of the arrays in a checkpoint: written with it, verified on load.

Orbax and tensorstore do not checksum array data, so one flipped byte on disk
would load as a wrong number. fleet stores a CRC-32 (``zlib.crc32``, a few GB/s)
of every array, per shard: ``{key: {shard index: crc}}``, where the shard index
is ``"0:16,0:8"`` (a replicated array or a numpy value has one shard, the whole
array). Each shard is summed by the process that writes it, and verified, after
reading and before anything is set in place, by every process that holds it.

A checkpoint says whether it was written with checksums (a step's ``meta``,
``fleet.save``'s ``fleet.json``: ``"checksum": "crc32"``); one that says so and
lacks the checksum of an array (:func:`missing`), or whose table cannot be read,
is damaged: deleting the table does not turn the check off.

The cost, measured by ``benchmarks/checkpoint_io.py``: one pass over the bytes
on save and one on restore, spread over a few threads (``zlib`` releases the
GIL).
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

ALGORITHM = "crc32"
#: Off only to measure what the check costs (benchmarks/checkpoint_io.py): nothing
#: is summed on save, nothing verified on load.
ENABLED = True
Sums = dict[str, dict[str, int]]  # {key: {shard index: crc}}


def crc32(x: Any) -> int:
    """CRC-32 of an array's bytes (C order)."""
    a = np.ascontiguousarray(np.asarray(x))
    return zlib.crc32(a.reshape(-1).view(np.uint8))


def index_key(index: tuple, shape: tuple[int, ...]) -> str:
    """``"0:4,0:16"``: a shard's index (a tuple of slices) written out."""
    return ",".join("{}:{}".format(*s.indices(n)[:2]) for s, n in zip(index, shape))


def whole(shape: tuple[int, ...]) -> str:
    """``"0:4,0:16"``: the index of an array's one shard, the whole array."""
    return ",".join(f"0:{n}" for n in shape)


def _pieces(values: dict[str, Any], written: bool) -> list[tuple[str, str, Any]]:
    """``(key, shard index, data)`` of the shards to sum: with ``written``, those
    this process writes (replica 0 of each shard, numpy values on process 0);
    otherwise one copy of every shard this process holds."""
    out = []
    for key, value in values.items():
        if isinstance(value, jax.Array):
            seen = set()
            for shard in value.addressable_shards:
                index = index_key(shard.index, value.shape)
                if (written and shard.replica_id != 0) or index in seen:
                    continue
                seen.add(index)
                out.append((key, index, shard.data))
        elif not written or jax.process_index() == 0:
            out.append((key, whole(np.shape(value)), value))
    return out


def sum_pieces(pieces: list[tuple[str, str, Any]]) -> Sums:
    """The checksum table of ``(key, shard index, data)`` pieces (:func:`host_pieces`)."""
    workers = min(8, os.cpu_count() or 1, max(1, len(pieces)))
    with ThreadPoolExecutor(workers) as pool:
        crcs = list(pool.map(lambda p: crc32(p[2]), pieces))
    sums: Sums = {}
    for (key, index, _), crc in zip(pieces, crcs):
        sums.setdefault(key, {})[index] = crc
    return sums


def checksums(values: dict[str, Any]) -> Sums:
    """The checksums of every shard of ``values``, as ``fleet.save`` writes them
    on any process."""
    if not ENABLED:
        return {}
    return sum_pieces(_pieces(values, written=False))


def host_pieces(values: dict[str, Any]) -> list[tuple[str, str, np.ndarray]]:
    """The shards this process writes, as host arrays (on CPU, views that keep the
    buffers alive), to be summed later by :func:`sum_pieces` in another thread."""
    if not ENABLED:
        return []
    return [(key, index, np.asarray(data)) for key, index, data in _pieces(values, written=True)]


def merge(all_sums: list[Sums]) -> Sums:
    """One table from every process's :func:`sum_pieces`."""
    out: Sums = {}
    for sums in all_sums:
        for key, shards in sums.items():
            out.setdefault(key, {}).update(shards)
    return out


def is_table(stored: Any) -> bool:
    """Whether ``stored`` (as read from JSON) is a table of :data:`Sums`."""
    return isinstance(stored, dict) and all(
        isinstance(shards, dict) and all(isinstance(crc, int) and not isinstance(crc, bool)
                                         for crc in shards.values())
        for shards in stored.values())


def missing(stored: Sums, values: dict[str, Any], quote: bool = True) -> list[str]:
    """The keys of ``values`` (as read) that ``stored`` has no checksum for: in a
    checkpoint written with checksums, a sign of damage (its table was cut)."""
    if not ENABLED:
        return []
    return [repr(k) if quote else k for k in values if not stored.get(k)]


def mismatches(stored: Sums, values: dict[str, Any], quote: bool = True) -> list[str]:
    """Every shard of ``values`` (as read) whose checksum differs from ``stored``.

    Shards without a stored checksum are not checked here (a checkpoint written
    before fleet stored checksums; an array read in other shards than it was
    written in): the caller asks :func:`missing` whether each key should have
    one. Keys are shown with ``repr`` if ``quote``.
    """
    if not ENABLED:
        return []
    pieces = [p for p in _pieces(values, written=False) if p[1] in stored.get(p[0], {})]
    got = sum_pieces(pieces)
    problems = []
    for key, index, _ in pieces:
        want = stored[key][index]
        if got[key][index] != want:
            where = "" if index == whole(np.shape(values[key])) else f" (shard [{index}])"
            name = repr(key) if quote else key
            problems.append(f"{name}{where}: {ALGORITHM} {got[key][index]:#010x} as read, "
                            f"{want:#010x} when written")
    return problems


def damage(bad: list[str], lost: list[str], lost_from: str) -> str:
    """Why the arrays read are not those written, ``""`` if they are: ``bad`` from
    :func:`mismatches`, ``lost`` from :func:`missing` (``lost_from`` says where the
    checksums should have been, and why)."""
    many = len(bad or lost) > 1
    if bad:
        return (f"{len(bad)} array{'s do' if many else ' does'} not match the checksum "
                f"written with {'them' if many else 'it'}:\n  " + "\n  ".join(bad))
    if lost:
        return (f"the checksum{'s' if many else ''} of {len(lost)} array{'s are' if many else ' is'} "
                f"missing{lost_from}:\n  " + "\n  ".join(lost))
    return ""
