"""Randomness in a step: every replica draws its own rows of the single-device draw.

A step runs once per replica, and its PRNG keys (an ``nnx.Rngs`` stream, a key
in a ``TrainState``, a key argument) are replicated: left alone, every replica
would draw the same dropout mask for its rows, the mask of the global batch's
first rows. fleet makes each replica draw *its own rows of the mask the
single-device step draws on the global batch*, bit for bit, as Keras 3's
``DataParallel`` does with a ``jit`` over sharded arrays. The step then equals the
single-device step, randomness included, and the keys themselves stay
replicated: no replica's RNG state ever differs.

How. Since jax 0.5, threefry is *partitionable* (``jax_threefry_partitionable``,
on by default): the bits of element ``i`` of a draw of shape ``S`` are
``threefry(key, i)``, ``i`` the element's row-major index in ``S``. A replica's
rows ``[r*b, (r+1)*b)`` of a global draw of shape ``(N*b, *rest)`` are thus the
bits of the counters ``r*b*prod(rest) + j`` for the ``j`` of a local draw of
shape ``(b, *rest)``. At the step's entry each threefry key of the state, the
pytree arguments and the replicated arguments is re-typed (same key data) as a
key of :func:`row_impl`, a PRNG implementation defined with JAX's public
``jax.extend.random.define_prng_impl``: its seed, split and fold-in are
threefry's own, so every key derived in the step is the one the single-device
step derives; its random bits, for a draw whose leading axis is the replica's
batch rows, are threefry's bits at the counters offset by the replica's first
global row (``jax.lax.axis_index``); for any other draw they are threefry's
bits. At the exit the keys go back to threefry, the very arrays that came in
where the step left them unchanged. Cost: the same number of threefry hashes as
the local draw, plus one 64-bit add per element.

A draw is *per example* when its leading axis has as many entries as a batch
argument's rows on this replica. What cannot be made exact is refused, naming
the draw (``fleet.semantics._random_guards``): a per-example draw from a key fleet did
not re-type (a raw ``uint32[2]`` key from ``jax.random.PRNGKey``, a key made or
closed over in the step) or with ``jax_threefry_partitionable`` off; a draw
that is not per example whose leading axis happens to equal the replica's rows;
a value made of a per-example draw alone that leaves the step typed the same on
every replica.

A draw's bits are exact; what the step does with them must be row-wise, as
everything in a data-parallel step must be: a random permutation of the batch
rows (mixup's shuffle) would permute each replica's rows among themselves, and a
step that sets them against the rows in order is refused
(:mod:`fleet.semantics._row_mixing`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import random as jex_random

from fleet import _compat
from fleet.runtime._leaves import is_key
from fleet.runtime._world import DATA_AXIS

_IMPLS: dict[frozenset, Any] = {}


def row_impl(rows: frozenset) -> Any:
    """The PRNG implementation of keys inside a step whose batch arguments have
    ``rows`` rows on each replica (one per set of row counts: JAX caches what it
    traced per key type, and the bits depend on the rows)."""
    impl = _IMPLS.get(rows)
    if impl is None:
        fry = _compat.threefry()

        def random_bits(key: jax.Array, bit_width: int, shape: tuple) -> jax.Array:
            if not (shape and shape[0] in rows):
                return fry.random_bits(key, bit_width, shape)
            first = jax.lax.axis_index(DATA_AXIS).astype(jnp.uint32)
            hi, lo = _add(_iota(shape), _mul(first, shape[0] * math.prod(shape[1:]), shape))
            return _bits(key, hi, lo, bit_width)

        impl = jex_random.define_prng_impl(
            key_shape=fry.key_shape, seed=fry.seed, split=fry.split, fold_in=fry.fold_in,
            random_bits=random_bits, name=f"fleet_rows{sorted(rows)}", tag="fleet")
        _IMPLS[rows] = impl
    return impl


def _bits(key: jax.Array, hi: jax.Array, lo: jax.Array, bit_width: int) -> jax.Array:
    """Partitionable threefry's bits at the 64-bit counters ``(hi, lo)`` (what
    ``jax.random.bits`` computes from the iota of the draw's shape)."""
    b1, b2 = jex_random.threefry2x32_p.bind(key[0], key[1], hi, lo)
    dtype = jnp.dtype(f"uint{bit_width}")
    if bit_width == 64:
        return (b1.astype(dtype) << jnp.asarray(32, dtype)) | b2.astype(dtype)
    if bit_width == 32:
        return b1 ^ b2
    return (b1 ^ b2).astype(dtype)


def _iota(shape: tuple) -> tuple[jax.Array, jax.Array]:
    """The row-major index of each element of ``shape``, as (hi, lo) uint32 words."""
    hi = jnp.zeros(shape, jnp.uint32)
    lo = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        if shape[axis] > 1:
            index = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
            hi, lo = _add((hi, lo), _mul(index, stride, shape))
        stride *= shape[axis]
    return hi, lo


def _mul(x: jax.Array, c: int, shape: tuple) -> tuple[jax.Array, jax.Array]:
    """``x * c`` modulo 2**64 as (hi, lo) uint32 words: ``x`` uint32, ``c`` a
    Python int below 2**64, each partial product of 16-bit limbs below 2**32."""
    x = jnp.broadcast_to(x, shape)
    hi = jnp.zeros(shape, jnp.uint32)
    lo = jnp.zeros(shape, jnp.uint32)
    xs = (x & jnp.uint32(0xFFFF), x >> jnp.uint32(16))
    for j in range(4):
        cj = (c >> (16 * j)) & 0xFFFF
        if not cj:
            continue
        for i, xi in enumerate(xs):
            p = xi * jnp.uint32(cj)
            shift = i + j  # in 16-bit limbs
            if shift == 0:
                part = (jnp.zeros_like(p), p)
            elif shift == 1:
                part = (p >> jnp.uint32(16), p << jnp.uint32(16))
            elif shift == 2:
                part = (p, jnp.zeros_like(p))
            elif shift == 3:
                part = (p << jnp.uint32(16), jnp.zeros_like(p))
            else:
                continue
            hi, lo = _add((hi, lo), part)
    return hi, lo


def _add(a: tuple, b: tuple) -> tuple[jax.Array, jax.Array]:
    lo = a[1] + b[1]
    return a[0] + b[0] + (lo < a[1]).astype(jnp.uint32), lo


@functools.cache
def replicated_impl() -> Any:
    """The PRNG implementation of the keys an optimizer's state holds inside a step:
    threefry's seed, split, fold-in and bits, under a name of its own (its draws
    are the single-device draws on every replica, and the guards of
    ``fleet.semantics._random_guards`` know them by their key type)."""
    fry = _compat.threefry()
    return jex_random.define_prng_impl(
        key_shape=fry.key_shape, seed=fry.seed, split=fry.split, fold_in=fry.fold_in,
        random_bits=fry.random_bits, name="fleet_replicated", tag="fleet_repl")


class Keys:
    """One trace's re-typed keys: :meth:`enter` at the step's entry, :meth:`leave`
    at its exit (state and outputs)."""

    def __init__(self, rows: frozenset):
        self.impl = row_impl(rows) if rows else None
        self._entered: dict[int, tuple] = {}  # id(re-typed) -> (re-typed, original)

    def enter(self, tree: Any, optimizer_held: Sequence[bool] | None = None) -> Any:
        """``tree``'s threefry keys re-typed: those an optimizer's state holds (the
        leaves of a flat list that ``optimizer_held`` flags, those under an
        ``opt_state`` attribute of a pytree) as :func:`replicated_impl`'s, the
        others as the rows' implementation's."""
        if self.impl is None:
            return tree
        if optimizer_held is not None:
            return [self._enter_leaf(x, replicated_impl() if held else self.impl)
                    for x, held in zip(tree, optimizer_held, strict=True)]
        return jax.tree_util.tree_map_with_path(
            lambda path, x: self._enter_leaf(x, replicated_impl() if any(
                getattr(k, "name", None) == "opt_state" for k in path) else self.impl),
            tree, is_leaf=_is_object)

    def _enter_leaf(self, x: Any, impl: Any) -> Any:
        if not (isinstance(x, jax.Array) and is_key(x) and jnp.result_type(x) == threefry_dtype()):
            return x
        typed = jax.random.wrap_key_data(jax.random.key_data(x), impl=impl)
        self._entered[id(typed)] = (typed, x)
        return typed

    def leave(self, tree: Any) -> Any:
        if self.impl is None:
            return tree
        return jax.tree.map(self._leave_leaf, tree, is_leaf=_is_object)

    def _leave_leaf(self, x: Any) -> Any:
        if not (isinstance(x, jax.Array) and is_key(x)) or jnp.result_type(x) not in (
                key_dtype(self.impl), key_dtype(replicated_impl())):
            return x
        entered = self._entered.get(id(x))
        if entered is not None and entered[0] is x:
            return entered[1]
        return jax.random.wrap_key_data(jax.random.key_data(x), impl=_compat.threefry())


def _is_object(x: Any) -> bool:
    return isinstance(x, nnx.Pytree)


_DTYPES: dict[int, Any] = {}


def key_dtype(impl: Any) -> Any:
    """The dtype of keys of ``impl`` (traced, nothing computed)."""
    dtype = _DTYPES.get(id(impl))
    if dtype is None:
        dtype = _DTYPES[id(impl)] = jax.eval_shape(lambda: jax.random.wrap_key_data(
            jnp.zeros(_compat.threefry().key_shape, jnp.uint32), impl=impl)).dtype
    return dtype


def threefry_dtype() -> Any:
    return key_dtype(_compat.threefry())

