"""``Model.summary``: Paddle's table of layers, shapes and parameter counts.

With the input shapes known (``input_size``, or ``fleet.Model(inputs=...)``),
the network runs once under Flax's ``nnx.tabulate`` on zeros of those shapes,
and each layer call it records (its ``row_filter`` hands over Flax's
``CallInfo``) becomes a row, in call order, as Paddle prints them::

    ---------------------------------------------------------------------------
     Layer (type)       Input Shape          Output Shape         Param #
    ===========================================================================
       Linear-1        float32[1,4]             [1, 3]               15
    ===========================================================================
    Total params: 15
    Trainable params: 15
    Non-trainable params: 0
    ---------------------------------------------------------------------------
    Input size (MB): 0.00
    Forward/backward pass size (MB): 0.00
    Params size (MB): 0.00
    Estimated Total Size (MB): 0.00
    ---------------------------------------------------------------------------

Without input shapes the table lists the layers that hold variables, with no
shapes. "Forward/backward pass size" is Paddle's estimate: twice the bytes of
every layer's outputs.
"""

from __future__ import annotations

import collections
import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fleet._errors import FleetConfigError
from fleet.hapi._inputs import input_dims

_MB = 2.0 ** 20
_WIDTHS = (20, 20, 20, 15)


def _own_variables(module: nnx.Module) -> list[nnx.Variable]:
    return [v for v in vars(module).values() if isinstance(v, nnx.Variable)
            and not isinstance(v, nnx.RngState)]


def _size(variables: list[nnx.Variable]) -> int:
    return sum(int(np.prod(np.shape(v.get_value()))) for v in variables)


def _type_name(cls: type) -> str:
    """The user's class: fleet's wrappers and layer subclasses carry theirs."""
    cls = getattr(cls, "fleet_base", cls)
    name = cls.__name__
    return name[len("DataParallel["):-1] if name.startswith("DataParallel[") else name


def _specs(input_size: Any, dtype: Any, inputs: Any) -> list[jax.ShapeDtypeStruct] | None:
    if input_size is None and inputs is not None and not isinstance(inputs, int):
        # fleet.Model(inputs=[InputSpec or ShapeDtypeStruct, ...]): unknown sizes are 1
        return [jax.ShapeDtypeStruct(tuple(1 if d is None else d for d in shape), dtype)
                for shape, dtype in input_dims(inputs)]
    if input_size is None:
        return None
    sizes = input_size if input_size and isinstance(input_size[0], (tuple, list)) else [input_size]
    dtypes = dtype if isinstance(dtype, (tuple, list)) else [dtype or np.float32] * len(sizes)
    if len(dtypes) != len(sizes):
        raise FleetConfigError(
            f"summary got {len(sizes)} input sizes but {len(dtypes)} dtypes; give one dtype "
            "per input, or one for all"
        )
    return [jax.ShapeDtypeStruct(tuple(int(d) for d in s), d) for s, d in zip(sizes, dtypes)]


def _shape_text(tree: Any) -> str:
    shapes = [list(x.shape) for x in jax.tree.leaves(tree) if hasattr(x, "shape")]
    return str(shapes[0] if len(shapes) == 1 else shapes)


def _calls(network: nnx.Module, specs: list) -> list[tuple[str, str, str, int, int]]:
    """(name, input, output, params, output bytes) per layer call, in call order."""
    calls: list = []
    nnx.tabulate(network, *[jnp.zeros(s.shape, s.dtype) for s in specs],
                 row_filter=lambda call: calls.append(call) and False)
    modules = {tuple(path): m for path, m in nnx.iter_modules(network)}
    counts: collections.Counter = collections.Counter()
    rows = []
    calls = [c for c in calls if not issubclass(c.type, (nnx.Rngs, nnx.RngStream))]
    for call in calls:
        path = tuple(call.path)
        while path and path not in modules:  # a method's name after the layer's path
            path = path[:-1]
        if not path and len(calls) > 1:  # the network itself, unless it is the one layer
            continue
        kind = _type_name(call.type)
        counts[kind] += 1
        params = _size(_own_variables(modules[path]))
        out_bytes = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                        for x in jax.tree.leaves(call.outputs) if hasattr(x, "shape")
                        and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))
        shown = re.sub(r"\[/?[a-z ]+\]", "", call.inputs_repr)  # Flax's rich markup
        rows.append((f"{kind}-{counts[kind]}", shown, _shape_text(call.outputs), params,
                     out_bytes))
    return rows


def summary(network: nnx.Module, input_size: Sequence[Any] | None = None, dtype: Any = None,
            file: TextIO | None = None, inputs: Any = None) -> dict[str, int]:
    specs = _specs(input_size, dtype, inputs)
    variables = [v for _, m in nnx.iter_modules(network) for v in _own_variables(m)]
    total = _size(variables)
    trainable = _size([v for v in variables if isinstance(v, nnx.Param)])
    param_bytes = sum(v.get_value().nbytes for v in variables)  # (no copy to the host)
    if specs is not None:
        rows = _calls(network, specs)
    else:
        rows = [(f"{name} ({_type_name(type(m))})", "", "", _size(_own_variables(m)), 0)
                for name, m in _named(network) if _own_variables(m)]
    line, double = "-" * 75, "=" * 75
    header = ("Layer (type)", "Input Shape", "Output Shape", "Param #")
    out = [line, "".join(h.center(w) for h, w in zip(header, _WIDTHS)), double]
    out += ["".join(str(c).center(w) for c, w in zip(r[:3] + (f"{r[3]:,}",), _WIDTHS))
            for r in rows]
    out += [double, f"Total params: {total:,}", f"Trainable params: {trainable:,}",
            f"Non-trainable params: {total - trainable:,}", line]
    input_mb = sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
                   for s in specs or []) / _MB
    passes_mb = 2 * sum(r[4] for r in rows) / _MB
    out += [f"Input size (MB): {input_mb:.2f}", f"Forward/backward pass size (MB): "
            f"{passes_mb:.2f}", f"Params size (MB): {param_bytes / _MB:.2f}",
            f"Estimated Total Size (MB): {input_mb + passes_mb + param_bytes / _MB:.2f}", line]
    print("\n".join(out), file=file if file is not None else sys.stdout, flush=True)
    return {"total_params": total, "trainable_params": trainable}


def _named(network: nnx.Module) -> list[tuple[str, nnx.Module]]:
    return [(".".join(map(str, path)) or "(network)", m) for path, m in nnx.iter_modules(network)]
