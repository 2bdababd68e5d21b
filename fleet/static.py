"""fleet.static: Paddle's ``paddle.static.InputSpec``, the shape and dtype of one
network input with its batch axis left open.

``fleet.Model(network, inputs=[fleet.static.InputSpec([None, 784], "float32", "x")])``
tells the model its inputs before it sees a batch: ``summary()`` prints the
table for a batch of one, ``save(path, training=False)`` exports the forward
pass for any batch size.

Why not ``jax.ShapeDtypeStruct``: jax 0.11.1 and later refuse ``None`` in its
shape (``ValueError: shape passed to ShapeDtypeStruct cannot have None in it``),
so ``jax.ShapeDtypeStruct((None, 784), jnp.float32)`` works only on jax 0.10.
``InputSpec`` holds an unknown dimension on every supported jax. A
``jax.ShapeDtypeStruct`` is still accepted by ``fleet.Model(inputs=...)``: its
first axis, the batch, is not read, so ``jax.ShapeDtypeStruct((1, 784),
jnp.float32)`` says the same on every jax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import numpy as jnp

from fleet._errors import FleetTypeError

__all__ = ["InputSpec"]


class InputSpec:
    """The shape and dtype of one input, Paddle's ``paddle.static.InputSpec``.

    Args:
        shape: the input's shape, its first axis the batch; ``None`` or ``-1`` for
            a dimension not known in advance (kept as ``-1``, as Paddle keeps it).
        dtype: a dtype or its name (``"float32"``, ``np.int32``, ``jnp.bfloat16``).
        name: the input's name (shown in ``repr``; fleet does not read it).
        stop_gradient: accepted for Paddle scripts (fleet does not read it).

    Raises:
        FleetTypeError: ``shape`` is not a list or tuple of ints / ``None``, or
            ``dtype`` is not a dtype.

    Example:
        >>> spec = fleet.static.InputSpec(shape=[None, 784], dtype="float32", name="x")
        >>> spec
        InputSpec(shape=(-1, 784), dtype=float32, name=x, stop_gradient=False)
        >>> model = fleet.Model(MLP(nnx.Rngs(0)), inputs=[spec])  # doctest: +SKIP
    """

    def __init__(self, shape: Sequence[int | None], dtype: Any = "float32",
                 name: str | None = None, stop_gradient: bool = False):
        self.shape = _shape(shape)
        self.dtype = _dtype(dtype)
        self.name = name
        self.stop_gradient = bool(stop_gradient)

    @classmethod
    def from_tensor(cls, tensor: Any, name: str | None = None) -> InputSpec:
        """The spec of an array (a ``jax.Array``, a NumPy array, anything with
        ``shape`` and ``dtype``), all of its dimensions known."""
        if not (hasattr(tensor, "shape") and hasattr(tensor, "dtype")):
            raise FleetTypeError(
                f"InputSpec.from_tensor takes an array (with shape and dtype), got "
                f"{type(tensor).__name__}; pass a jax or NumPy array")
        return cls(tuple(tensor.shape), tensor.dtype, name)

    from_numpy = from_tensor

    def batch(self, batch_size: int) -> InputSpec:
        """This spec with a batch axis of ``batch_size`` in front."""
        return InputSpec((batch_size, *self.shape), self.dtype, self.name, self.stop_gradient)

    def unbatch(self) -> InputSpec:
        """This spec without its first axis."""
        if not self.shape:
            raise FleetTypeError(f"{self!r} has no axis to remove: unbatch() needs at least one")
        return InputSpec(self.shape[1:], self.dtype, self.name, self.stop_gradient)

    def __repr__(self) -> str:
        return (f"InputSpec(shape={self.shape}, dtype={self.dtype}, name={self.name}, "
                f"stop_gradient={self.stop_gradient})")

    def _fields(self) -> tuple:
        return (self.shape, self.dtype, self.name, self.stop_gradient)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InputSpec) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    ok = isinstance(shape, (list, tuple)) and all(
        d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= -1)
        for d in shape)
    if not ok:
        raise FleetTypeError(
            f"InputSpec shape {shape!r} is not a list of dimensions; give ints, with None "
            "(or -1) for one not known in advance, e.g. InputSpec([None, 784], 'float32')")
    return tuple(-1 if d is None else int(d) for d in shape)


def _dtype(dtype: Any) -> np.dtype:
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise FleetTypeError(
            f"InputSpec dtype {dtype!r} is not a dtype; give one or its name, e.g. "
            "'float32', 'int32', np.float32, jnp.bfloat16") from None


def dims(spec: Any) -> tuple[tuple[int | None, ...], Any] | None:
    """``(shape, dtype)`` of an input spec, ``None`` for each unknown dimension:
    an :class:`InputSpec`, or anything with ``shape`` and ``dtype`` (a
    ``jax.ShapeDtypeStruct``); ``None`` if ``spec`` is neither."""
    if isinstance(spec, InputSpec):
        return tuple(None if d == -1 else d for d in spec.shape), spec.dtype
    if hasattr(spec, "shape") and hasattr(spec, "dtype"):  # a symbolic dimension: unknown
        return tuple(int(d) if isinstance(d, (int, np.integer)) else None
                     for d in spec.shape), spec.dtype
    return None
