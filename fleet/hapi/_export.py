"""``Model.save(path, training=False)`` and :func:`load_inference`: the network as
a program, runnable without its Python class (Paddle's inference model and
``paddle.jit.load``; the user's view is in docs/model.md).

``save`` traces the network's forward pass in evaluation mode and serializes
it with ``jax.export``: StableHLO, lowered for CPU and CUDA together, with a
symbolic batch dimension, so the file runs on either and on any batch size.
Two files, Paddle's pair:

* ``{path}.jaxexport``: ``jax.export.Exported.serialize()``; the program takes
  the weights (a list of arrays) and the network's inputs;
* ``{path}.pdiparams``: those weights, written with :func:`fleet.save`
  (``{"names": [...], "weights": [...], "jax": version, "program": {"size": n,
  "crc32": crc}}``: the variables' dotted names and values, in the program's
  order, the jax that exported them, and the record of the ``.jaxexport``
  bytes written beside it, :mod:`fleet.hapi._export_check`).

The ``.pdiparams`` is written first, then the ``.jaxexport``, each atomically:
a save that dies between them leaves a pair whose record does not match its
program, which :func:`load_inference` refuses rather than runs. What it checks
before it runs anything, and the pairs exported before the record existed:
:mod:`fleet.hapi._export_check`.

A program loads on the jax that exported it and on later ones (jax's
compatibility window), not on an earlier one: jax 0.10 cannot read what jax 0.12
exports. :func:`load_inference` then names both versions.

Random state (dropout's keys) is not an input: evaluation does not use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from fleet import checkpoint
from fleet._errors import FleetConfigError, FleetError
from fleet.checkpoint import FleetCheckpointError, _atomic
from fleet.checkpoint._errors import first_line
from fleet.hapi import _export_check
from fleet.hapi._inputs import SPEC_EXAMPLE, input_dims
from fleet.runtime import _world
from fleet.runtime._leaves import dotted
from fleet.sections import _stage3

EXPORT_SUFFIX = ".jaxexport"
WEIGHTS_SUFFIX = ".pdiparams"
PLATFORMS = ("cpu", "cuda")


def input_specs(given: Any, seen: Sequence[Any]) -> list:
    """The inputs' specs with a symbolic batch axis: from ``fleet.Model(inputs=...)``
    (its first axis, the batch, is made symbolic whatever it says), else from the
    last batch the model ran (``seen``, its input arrays)."""
    specs = given if isinstance(given, (list, tuple)) else [
        jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)) for x in seen]
    if not specs:
        raise FleetConfigError(
            "Model.save(path, training=False) exports the network for a batch of inputs of "
            f"known shapes, and this model has none: give them, fleet.Model(network, "
            f"inputs=[{SPEC_EXAMPLE}]) (one per input; the first axis is the batch), or run "
            "fit / evaluate / predict first")
    batch = jax.export.symbolic_shape("batch")[0]
    out = []
    for i, (s, (shape, dtype)) in enumerate(zip(specs, input_dims(specs))):
        if None in shape[1:]:
            raise FleetConfigError(
                f"fleet.Model(inputs=...) entry {i} is {s!r}: only its first axis (the batch) "
                "may be unknown for Model.save(path, training=False); give the size of every "
                f"other axis, e.g. {SPEC_EXAMPLE}")
        out.append(jax.ShapeDtypeStruct((batch, *shape[1:]), dtype))
    return out


def export(network: nnx.Module, specs: list, path: str) -> None:
    """Writes ``{path}.jaxexport`` and ``{path}.pdiparams`` (on the first worker; the
    others wait)."""
    # (stage 3's parameters whole: fleet.sections._stage3)
    graphdef, rng_state, weights = nnx.split(_stage3.whole_copy(network), nnx.RngState, ...)
    flat, treedef = jax.tree_util.tree_flatten_with_path(weights)
    names = [dotted(p) for p, _ in flat]
    values = [np.asarray(x) for _, x in flat]

    def forward(leaves, *inputs):
        model = nnx.merge(graphdef, rng_state, jax.tree_util.tree_unflatten(treedef, leaves))
        model.eval()
        return model(*inputs)

    leaf_specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]
    exported = jax.export.export(jax.jit(forward), platforms=PLATFORMS)(leaf_specs, *specs)
    program = bytes(exported.serialize())
    if _world.is_first_worker():  # both written atomically, as fleet.save writes
        checkpoint.save({"names": names, "weights": values, "jax": jax.__version__,
                         _export_check.RECORD: _export_check.record(program)},
                        path + WEIGHTS_SUFFIX)
        _atomic.write(os.path.abspath(path + EXPORT_SUFFIX), program)
    _world.barrier_worker()


def load_inference(path: str | os.PathLike) -> Callable[..., Any]:
    """The network saved by ``Model.save(path, training=False)``, as a function of its
    inputs: ``predict = fleet.load_inference("out/infer"); logits = predict(x)``.

    It runs the saved program (on this machine's default backend, CPU or CUDA, and
    on any batch size) with the saved weights; the model's Python class is not
    needed. Paddle's ``paddle.jit.load``.

    Raises:
        FleetCheckpointError: a file is damaged or the two do not belong together:
            the program's size or CRC-32 is not the one recorded in ``.pdiparams``
            (checked before jax reads the program), or a weight's shape or dtype is
            not what the program takes (the message names it).
        FleetError: a file is missing, or jax cannot read the program (one exported
            by a newer jax: the message names both versions); at a call, inputs of
            another number, rank, dtype or fixed dimension than the program takes.

    Example:
        >>> predict = fleet.load_inference("out/infer")  # doctest: +SKIP
        >>> predict(np.ones((5, 784), np.float32)).shape
        (5, 10)
    """
    path = os.fspath(path)
    for suffix in (EXPORT_SUFFIX, WEIGHTS_SUFFIX):
        if not os.path.exists(path + suffix):
            raise FleetError(
                f"no {path + suffix!r}: pass the path given to Model.save(path, "
                f"training=False) (it writes {path}{EXPORT_SUFFIX} and {path}{WEIGHTS_SUFFIX})")
    saved = checkpoint.load(path + WEIGHTS_SUFFIX)
    names, values = _export_check.weights_of(path, saved)
    program, checked = _export_check.read_program(path, EXPORT_SUFFIX, saved)
    newer = _newer_jax(saved.get("jax"))  # (None: saved by fleet before issue 35)
    try:
        exported = jax.export.deserialize(bytearray(program))
    except Exception as e:  # noqa: BLE001 (the last resort: damage was ruled out above)
        raise _unreadable(path, saved.get("jax"), newer, checked, e) from e
    _export_check.check_weights(path, exported, names, values)
    weights = [jax.numpy.asarray(w) for w in values]
    call = jax.jit(exported.call)

    def predict(*inputs: Any) -> Any:
        _export_check.check_inputs(path, exported, inputs)
        try:
            return call(weights, *inputs)
        except Exception as e:  # noqa: BLE001 (StableHLO deserialization: at the first call)
            if newer:
                raise _too_new(path, newer) from e
            raise

    predict.exported = exported  # type: ignore[attr-defined]  # its shapes and platforms
    return predict


def _unreadable(path: str, saved: Any, newer: str | None, checked: bool,
                e: Exception) -> FleetError:
    """The error for a program jax cannot deserialize (its cause is jax's error)."""
    if newer:
        return _too_new(path, newer)
    if checked:
        by = (f"it was exported by jax {saved} (jax reads the programs of earlier versions "
              f"for a while, not forever): load it with jax {saved}, or export it again here"
              if isinstance(saved, str) and saved != jax.__version__
              else "export it again")
        return FleetError(
            f"jax {jax.__version__} cannot read {path}{EXPORT_SUFFIX} ({first_line(e)}), "
            f"although it is the file that was saved (its size and checksum match); {by} "
            "with Model.save(path, training=False)")
    return FleetCheckpointError(
        f"fleet.load_inference: jax cannot read {path}{EXPORT_SUFFIX} ({first_line(e)}); it "
        f"has no checksum (exported before fleet recorded one), so it is most likely damaged "
        f"(cut short or changed on disk): {_export_check.AGAIN}")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def _newer_jax(saved: Any) -> str | None:
    """The jax version that exported a program, if it is newer than this one."""
    if isinstance(saved, str) and _version(saved) > _version(jax.__version__):
        return saved
    return None


def _too_new(path: str, saved: str) -> FleetError:
    return FleetError(
        f"{path}{EXPORT_SUFFIX} was exported by jax {saved}, and this is jax {jax.__version__}, "
        f"which cannot read it (jax reads programs of its own version and earlier ones); "
        f"load it with jax {saved} or later, or save it again here with "
        f"Model.save(path, training=False)")
