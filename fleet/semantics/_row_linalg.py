"""The rows' rules of linear algebra and Fourier transforms
(:mod:`fleet.semantics._row_mixing`'s walk).

A matrix decomposition (``jnp.linalg.svd``, ``qr``, ``cholesky``, ``eigh``, the
``lu`` of ``slogdet``, ``solve`` and ``inv``) or a Fourier transform whose
matrix or transform axes hold the replica's rows computes each replica's value
from its own rows alone, where the single-device step's is of the global
batch's: refused, naming it. Over other axes (a batch of per-example matrices
or signals) it keeps the rows where they were. A decomposition of a value
reduced over the rows (the Gram matrix ``z.T @ z / n`` of a whitening or a
log-determinant loss) is such a value too (as the walk takes any equation
without rows among its inputs: ``fleet.semantics._row_mixing``), refused where
it then meets the rows, as its gradient does.
"""

from __future__ import annotations

from typing import Any

from fleet.semantics._row_tags import PARTIAL, UNKNOWN, is_row

#: decompositions of the last two axes of their one input (batch axes before them)
_DECOMPOSITIONS = frozenset(("svd", "cholesky", "lu", "qr", "eigh", "eig", "schur",
                             "householder_product", "geqrf", "tridiagonal"))


def _decomposition(walk: Any, eqn: Any, ins: list) -> list:
    t = ins[0]
    if not any(map(is_row, ins)):  # (of values reduced over the rows: such a value)
        return [PARTIAL] * len(eqn.outvars)
    if not is_row(t) or any(x is not None for x in ins[1:]):
        return [UNKNOWN] * len(eqn.outvars)
    if t.axis >= eqn.invars[0].aval.ndim - 2:
        walk.refuse(eqn, f"a matrix decomposition of the rows ({eqn.primitive.name}: "
                         "jnp.linalg.svd, qr, cholesky, eigh, slogdet, solve of a matrix "
                         "whose rows or columns are the batch's)")
    return [t] * len(eqn.outvars)


def _triangular_solve(walk: Any, eqn: Any, ins: list) -> list:
    """``a x = b`` (``left_side``) or ``x a = b``: each of ``b``'s columns (rows)
    solved alone; along the other of its two last axes the solve mixes."""
    a, b = ins
    ndim = eqn.invars[1].aval.ndim
    if not is_row(a) and not is_row(b):
        return [PARTIAL]
    if is_row(a) and a.axis >= ndim - 2:
        walk.refuse(eqn, "a triangular solve with a matrix of the rows "
                         "(jax.scipy.linalg.solve_triangular)")
    if not is_row(b) or a not in (None, b):
        return [UNKNOWN]
    if b.axis == (ndim - 2 if eqn.params["left_side"] else ndim - 1):
        walk.refuse(eqn, "a triangular solve over the rows (jax.scipy.linalg.solve_triangular "
                         "with the batch's rows on the solved axis)")
    return [b]


def _fft(walk: Any, eqn: Any, ins: list) -> list:
    t = ins[0]
    if not is_row(t):
        return [PARTIAL]
    if t.axis >= eqn.invars[0].aval.ndim - len(eqn.params["fft_lengths"]):
        walk.refuse(eqn, "a Fourier transform over the rows (jnp.fft over the batch's axis)")
    return [t]


LINALG_RULES = {**{name: _decomposition for name in _DECOMPOSITIONS},
                "triangular_solve": _triangular_solve, "fft": _fft}
