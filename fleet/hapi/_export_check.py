"""The inference pair, checked before it runs: the program's checksum, and the
weights' fit to the program.

``Model.save(path, training=False)`` records, in ``{path}.pdiparams``, the size
and CRC-32 of the program it wrote beside it (``"program": {"size": 3752,
"crc32": 2868355409}``; the CRC is :mod:`fleet.checkpoint._integrity`'s, of the
file's bytes). ``.pdiparams`` is a :func:`fleet.save` file, so that record is
itself checked when it is read (its JSON is a zip entry with zip's CRC-32, its
arrays carry their own). :func:`read_program` reads ``{path}.jaxexport`` and
compares it with the record before jax deserializes a byte of it: a file cut
short, or with any byte changed (CRC-32 catches every change of up to 32
consecutive bits, and every single flipped byte), or a ``.jaxexport`` of
another save (a ``.pdiparams`` copied from another model) is refused, naming
both sizes and both checksums. Measured without the check (a 3,760-byte
program, issue 38): a file cut at 0, 16 or half its bytes raised the struct
module's error from jax's reader, and one cut by its last byte loaded; of 64
bytes flipped across the file, 37 raised jax's, flatbuffers' or the struct
module's own errors (7 struct.error, 25 JaxRuntimeError, 5 others) and 27
loaded (bytes that jax does not read: none gave other outputs), so nothing
noticed them.

A pair exported before fleet wrote the record (fleet up to issue 37) has no
checksum: it loads as before, unchecked, and a :class:`fleet.FleetWarning`
says so (Python's default warning filter shows it once per path and calling
line); exporting it again adds one. Such a pair was measured to load and run
the same under both fleets, and a new pair under the earlier fleet (which
ignores the record).

:func:`check_weights` then compares the weights with what the deserialized
program takes (``Exported.in_avals``): their number, and each one's shape and
dtype, named by the weight's dotted name, so another model's weights, or
weights whose shapes changed, are refused at load time rather than failing
inside jax's call.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from fleet._errors import FleetError, FleetWarning
from fleet.checkpoint import FleetCheckpointError, _integrity

#: The key of the program's record in ``{path}.pdiparams``.
RECORD = "program"
#: What to do when the pair does not hold together.
AGAIN = ("copy both files again from where Model.save(path, training=False) wrote them, "
         "or export again with Model.save(path, training=False)")


def record(program: bytes) -> dict[str, int]:
    """``{"size": bytes, "crc32": crc}`` of a serialized program, for ``.pdiparams``."""
    return {"size": len(program), _integrity.ALGORITHM: _crc(program)}


def _crc(program: bytes) -> int:
    return _integrity.crc32(np.frombuffer(program, np.uint8))


def read_program(path: str, suffix: str, saved: dict) -> tuple[bytes, bool]:
    """The bytes of ``{path}{suffix}``, verified against the record in the weights
    file ``saved`` (as :func:`fleet.load` read it); ``(bytes, checked)``."""
    with open(path + suffix, "rb") as f:
        program = f.read()
    if RECORD not in saved:
        warnings.warn(
            f"fleet.load_inference: {path}{suffix} has no checksum (it was exported by a "
            "fleet that did not record one), so it is loaded unchecked: damage to it shows "
            "only as an error from jax, or not at all. Export it again with "
            "Model.save(path, training=False) to add one", FleetWarning, stacklevel=3)
        return program, False
    want = saved[RECORD]
    if not (isinstance(want, dict) and all(isinstance(want.get(k), int) and not isinstance(
            want.get(k), bool) for k in ("size", _integrity.ALGORITHM))):
        raise FleetCheckpointError(
            f"fleet.load_inference: {path}.pdiparams is damaged: its {RECORD!r} entry is "
            f"{want!r}, not {{'size': int, {_integrity.ALGORITHM!r}: int}} as "
            f"Model.save(path, training=False) writes it; {AGAIN}")
    size, crc = want["size"], want[_integrity.ALGORITHM]
    got = _crc(program)
    if len(program) != size or got != crc:
        raise FleetCheckpointError(
            f"fleet.load_inference: {path}{suffix} is not the program that {path}.pdiparams "
            f"was saved with: it has {len(program)} bytes, {_integrity.ALGORITHM} {got:#010x}, "
            f"and {path}.pdiparams recorded {size} bytes, {_integrity.ALGORITHM} {crc:#010x}. "
            f"{_why(len(program), size)} Nothing was loaded: {AGAIN}")
    return program, True


def _why(found: int, size: int) -> str:
    if found < size:
        return ("It is shorter than saved: it was cut short (an interrupted copy or write, "
                "a full disk), or it comes from another save than the .pdiparams.")
    if found == size:
        return ("Its bytes changed after it was saved (on disk or in transfer), or it comes "
                "from another save than the .pdiparams.")
    return "It is longer than saved: it comes from another save than the .pdiparams."


def weights_of(path: str, saved: Any) -> tuple[list[str], list[np.ndarray]]:
    """The weights' names and values in a ``.pdiparams`` (as :func:`fleet.load` read
    it), or a named error if it is not one ``Model.save(path, training=False)`` wrote."""
    names = saved.get("names") if isinstance(saved, dict) else None
    weights = saved.get("weights") if isinstance(saved, dict) else None
    if not (isinstance(names, list) and isinstance(weights, list) and len(names) == len(weights)
            and all(isinstance(w, np.ndarray) for w in weights)):
        what = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise FleetCheckpointError(
            f"fleet.load_inference: {path}.pdiparams holds {what}, not the inference weights "
            "Model.save(path, training=False) writes (equally long lists 'names' and 'weights' "
            "of arrays, and 'jax'): a .pdparams file saved for training does not load here; "
            f"{AGAIN}")
    return names, weights


def _spec(shape: Any, dtype: Any) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def check_weights(path: str, exported: jax.export.Exported, names: list[str],
                  weights: list[np.ndarray]) -> None:
    """Raises a named error unless ``weights`` are what ``exported`` takes as its
    first argument, one by one (shape and dtype)."""
    args = jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals)
    positional = args[0] if isinstance(args, tuple) and len(args) == 2 else None
    takes = positional[0] if isinstance(positional, tuple) and positional else None
    if not isinstance(takes, list):
        raise FleetCheckpointError(
            f"fleet.load_inference: {path}.jaxexport takes {exported.in_tree}, not (weights, "
            f"*inputs) as a program Model.save(path, training=False) exported does; {AGAIN}")
    problems = [f"{name!r}: {_spec(w.shape, w.dtype)} in the weights, "
                f"{_spec(a.shape, a.dtype)} in the program"
                for name, w, a in zip(names, weights, takes)
                if tuple(w.shape) != tuple(a.shape) or w.dtype != a.dtype]
    if len(weights) != len(takes):
        problems.insert(0, f"the program takes {len(takes)} weights, {path}.pdiparams holds "
                           f"{len(weights)}")
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more"
                                           if len(problems) > 6 else "")
        raise FleetCheckpointError(
            f"fleet.load_inference: the weights in {path}.pdiparams do not fit the program "
            f"{path}.jaxexport ({shown}): they are another model's weights, or were changed "
            "after saving. Pass the .pdiparams saved with this program (Model.save(path, "
            "training=False) writes both), or export again")


def check_inputs(path: str, exported: jax.export.Exported, inputs: tuple) -> None:
    """Raises a named error unless ``inputs`` are what the program takes after its
    weights: their number, and each one's rank, dtype and fixed dimensions (a
    symbolic one, the batch, takes any size)."""
    takes = jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals)[0][1:]
    if len(inputs) != len(takes):
        raise FleetError(
            f"the program {path}.jaxexport takes {len(takes)} input(s) "
            f"({', '.join(_spec(a.shape, a.dtype) for a in takes)}), given {len(inputs)}: call it with "
            "the inputs the model's forward took when it was saved")
    for i, (x, want) in enumerate(zip(inputs, takes), 1):
        got_leaves, want_leaves = jax.tree.leaves(x), jax.tree.leaves(want)
        bad = len(got_leaves) != len(want_leaves) or any(
            np.ndim(g) != len(w.shape) or np.result_type(g) != w.dtype or any(
                isinstance(d, int) and d != n for d, n in zip(w.shape, np.shape(g)))
            for g, w in zip(got_leaves, want_leaves))
        if bad:
            given = ", ".join(_spec(np.shape(g), np.result_type(g)) for g in got_leaves)
            raise FleetError(
                f"input {i} of the program {path}.jaxexport must be "
                f"{', '.join(_spec(w.shape, w.dtype) for w in want_leaves)} (a named dimension takes "
                f"any size), given {given}: pass an array of that shape and dtype (the "
                "shape the model's forward took when it was saved)")
