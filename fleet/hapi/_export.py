"""``Model.save(path, training=False)`` and :func:`load_inference`: the network as
a program, runnable without its Python class (Paddle's inference model and
``paddle.jit.load``).

``save`` traces the network's forward pass in evaluation mode and serializes
it with ``jax.export``: StableHLO, lowered for CPU and CUDA together, with a
symbolic batch dimension, so the file runs on either and on any batch size.
Two files, Paddle's pair:

* ``{path}.jaxexport``: ``jax.export.Exported.serialize()``; the program takes
  the weights (a list of arrays) and the network's inputs;
* ``{path}.pdiparams``: those weights, written with :func:`fleet.save`
  (``{"names": [...], "weights": [...], "jax": version}``: the variables' dotted
  names and values, in the program's order, and the jax that exported them).

A program loads on the jax that exported it and on later ones (jax's
compatibility window), not on an earlier one: jax 0.10 cannot read what jax 0.12
exports. :func:`load_inference` then names both versions.

The input shapes come from ``fleet.Model(network, inputs=[...])`` (a
``fleet.static.InputSpec`` per input, or a ``jax.ShapeDtypeStruct``; its first
axis, the batch, is made symbolic whatever it says), or else from the last batch
the model ran.
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
from fleet.checkpoint import _atomic
from fleet.runtime import _world
from fleet.runtime._leaves import dotted
from fleet.static import dims

#: What ``fleet.Model(inputs=...)`` takes, on every supported jax (jax 0.11.1 and
#: later refuse ``jax.ShapeDtypeStruct((None, 784), ...)``: fleet/static.py).
SPEC_EXAMPLE = "fleet.static.InputSpec([None, 784], 'float32', name='x')"

EXPORT_SUFFIX = ".jaxexport"
WEIGHTS_SUFFIX = ".pdiparams"
PLATFORMS = ("cpu", "cuda")


def input_specs(given: Any, seen: Sequence[Any]) -> list:
    """The inputs' specs with a symbolic batch axis: from ``fleet.Model(inputs=...)``,
    else from the last batch the model ran (``seen``, its input arrays)."""
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
    for i, s in enumerate(specs):
        shape, dtype = dims(s) or ((), None)
        if len(shape) < 1:
            raise FleetConfigError(
                f"fleet.Model(inputs=...) entry {i} is {s!r}; give a fleet.static.InputSpec "
                f"whose first axis is the batch, e.g. {SPEC_EXAMPLE}")
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
    graphdef, rng_state, weights = nnx.split(network, nnx.RngState, ...)
    flat, treedef = jax.tree_util.tree_flatten_with_path(weights)
    names = [dotted(p) for p, _ in flat]
    values = [np.asarray(x) for _, x in flat]

    def forward(leaves, *inputs):
        model = nnx.merge(graphdef, rng_state, jax.tree_util.tree_unflatten(treedef, leaves))
        model.eval()
        return model(*inputs)

    leaf_specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]
    exported = jax.export.export(jax.jit(forward), platforms=PLATFORMS)(leaf_specs, *specs)
    if _world.is_first_worker():  # both written atomically, as fleet.save writes
        checkpoint.save({"names": names, "weights": values, "jax": jax.__version__},
                        path + WEIGHTS_SUFFIX)
        _atomic.write(os.path.abspath(path + EXPORT_SUFFIX), bytes(exported.serialize()))
    _world.barrier_worker()


def load_inference(path: str | os.PathLike) -> Callable[..., Any]:
    """The network saved by ``Model.save(path, training=False)``, as a function of its
    inputs: ``predict = fleet.load_inference("out/infer"); logits = predict(x)``.

    It runs the saved program (on this machine's default backend, CPU or CUDA, and
    on any batch size) with the saved weights; the model's Python class is not
    needed. Paddle's ``paddle.jit.load``.
    """
    path = os.fspath(path)
    for suffix in (EXPORT_SUFFIX, WEIGHTS_SUFFIX):
        if not os.path.exists(path + suffix):
            raise FleetError(
                f"no {path + suffix!r}: pass the path given to Model.save(path, "
                f"training=False) (it writes {path}{EXPORT_SUFFIX} and {path}{WEIGHTS_SUFFIX})")
    saved = checkpoint.load(path + WEIGHTS_SUFFIX)
    weights = [jax.numpy.asarray(w) for w in saved["weights"]]
    newer = _newer_jax(saved.get("jax"))  # (None: saved by fleet before issue 35)
    try:
        with open(path + EXPORT_SUFFIX, "rb") as f:
            exported = jax.export.deserialize(bytearray(f.read()))
    except Exception as e:  # noqa: BLE001 (flatbuffers' and jax's own errors)
        if newer:
            raise _too_new(path, newer) from e
        raise
    call = jax.jit(exported.call)

    def predict(*inputs: Any) -> Any:
        try:
            return call(weights, *inputs)
        except Exception as e:  # noqa: BLE001 (StableHLO deserialization: at the first call)
            if newer:
                raise _too_new(path, newer) from e
            raise

    predict.exported = exported  # type: ignore[attr-defined]  # its shapes and platforms
    return predict


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
