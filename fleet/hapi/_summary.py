"""``Model.summary``: a table of the network's layers and parameter counts."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TextIO

import jax
import numpy as np
from flax import nnx

from fleet._errors import FleetConfigError
from fleet._tree import dotted


def _rows(network: nnx.Module) -> list[tuple[str, str, str, int, int]]:
    """(path, type, parameter shapes, parameters, trainable) for each layer that
    holds variables of its own, in definition order."""
    rows = []
    for path, module in nnx.iter_modules(network):
        own = [(name, v) for name, v in vars(module).items() if isinstance(v, nnx.Variable)
               and not isinstance(v, (nnx.RngKey, nnx.RngCount))]
        if not own:
            continue
        shapes = ", ".join(f"{name}{list(np.shape(v.get_value()))}" for name, v in own)
        total = sum(int(np.prod(np.shape(v.get_value()))) for _, v in own)
        trainable = sum(int(np.prod(np.shape(v.get_value()))) for _, v in own
                        if isinstance(v, nnx.Param))
        name = dotted(path) or "(network)"
        kind = type(module).__name__
        if kind.startswith("DataParallel["):
            kind = kind[len("DataParallel["):-1]
        rows.append((name, kind, shapes, total, trainable))
    return rows


def output_shape(network: nnx.Module, input_size: Any, dtype: Any) -> Any:
    """The network's output shapes for inputs of ``input_size`` (nothing runs)."""
    sizes = input_size if input_size and isinstance(input_size[0], (tuple, list)) else [input_size]
    dtypes = dtype if isinstance(dtype, (tuple, list)) else [dtype or np.float32] * len(sizes)
    if len(dtypes) != len(sizes):
        raise FleetConfigError(
            f"summary got {len(sizes)} input sizes but {len(dtypes)} dtypes; give one dtype "
            "per input, or one for all"
        )
    specs = [jax.ShapeDtypeStruct(tuple(int(d) for d in s), d) for s, d in zip(sizes, dtypes)]
    graphdef, state = nnx.split(network)
    out = jax.eval_shape(lambda st, *xs: nnx.merge(graphdef, st)(*xs), state, *specs)
    return jax.tree.map(lambda x: tuple(x.shape), out)


def summary(network: nnx.Module, input_size: Sequence[Any] | None = None, dtype: Any = None,
            file: TextIO | None = None, inputs: Any = None) -> dict[str, int]:
    if input_size is None and inputs is not None and not isinstance(inputs, int):
        # fleet.Model(inputs=[ShapeDtypeStruct, ...]): Paddle's InputSpec list
        input_size = [tuple(1 if d is None else d for d in s.shape) for s in inputs]
        dtype = [s.dtype for s in inputs]
    rows = _rows(network)
    header = ("Layer (type)", "Parameter shapes", "Param #")
    table = [(f"{name} ({kind})", shapes, f"{total:,}") for name, kind, shapes, total, _ in rows]
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(3)]
    line = "-" * (sum(widths) + 6)
    out = [line, "  ".join(h.ljust(w) for h, w in zip(header, widths)), "=" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in table]
    total = sum(r[3] for r in rows)
    trainable = sum(r[4] for r in rows)
    out += ["=" * len(line), f"Total params: {total:,}", f"Trainable params: {trainable:,}",
            f"Non-trainable params: {total - trainable:,}"]
    if input_size is not None:
        out.append(f"Input size: {input_size} -> output shape: "
                   f"{output_shape(network, input_size, dtype)}")
    out.append(line)
    print("\n".join(out), file=file if file is not None else sys.stdout, flush=True)
    return {"total_params": total, "trainable_params": trainable}
