"""Whether two invariant values of the replica's trace and the reference trace are
computed alike from the same inputs: :meth:`fleet.semantics._outputs_walk.Walk.same`,
which needs it for a term of the parameters (an L2 penalty) and for the values
``fleet.all_reduce`` makes, the same in both traces."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.extend.core import Literal

from fleet.semantics._jaxpr_scope import Scope, all_of, is_varying_var
from fleet.semantics._outputs_scan import same_carry
from fleet.semantics._rows_alike import alike_rows, gathered_rows


def same(walk: Any, a: Any, sa: Scope, b: Any, sb: Scope) -> bool:
    """Whether two invariant values are computed alike from the same inputs (each
    pair looked at once, in a loop: an L2 penalty of a deep model's parameters is a
    chain of hundreds of sums)."""
    return all_of((a, sa, b, sb), lambda p: (id(p[0]), id(p[2])),
                  lambda *p: _same(walk, *p), walk.same_memo)


def _same(walk: Any, a: Any, sa: Scope, b: Any, sb: Scope) -> bool | list:
    """Whether ``a`` and ``b`` are alike, when that is known from them; else the
    pairs ``(x, sx, y, sy)`` they are alike exactly when all of them are."""
    if isinstance(a, Literal) or isinstance(b, Literal):
        return (isinstance(a, Literal) and isinstance(b, Literal)
                and np.array_equal(np.asarray(a.val), np.asarray(b.val)))
    if id(a) in sa.inputs or id(b) in sb.inputs:
        if id(a) not in sa.inputs or id(b) not in sb.inputs:
            return False
        if sa.parent is None or sb.parent is None:  # the body's own inputs: the state
            return (sa.parent is None and sb.parent is None
                    and sa.inputs[id(a)] == sb.inputs[id(b)])
        return [(sa.parent[0][sa.inputs[id(a)]], sa.parent[1],
                 sb.parent[0][sb.inputs[id(b)]], sb.parent[1])]
    ea, eb = sa.producer.get(id(a)), sb.producer.get(id(b))
    if walk.global_calls and ea is not None and eb is not None and (
            gathered := gathered_rows(ea, sa, eb, sb)):
        alike = alike_rows(walk, *gathered)  # (every replica's rows: a MoCo queue's keys)
        walk.gathered_unlike = walk.gathered_unlike or not alike
        return alike
    if ea is None or eb is None or ea.primitive != eb.primitive or len(ea.invars) != len(
            eb.invars) or a.aval.shape != b.aval.shape:
        return False
    if ea.outvars.index(a) != eb.outvars.index(b):
        return False
    if walk.global_calls and ea.primitive.name == "scan":
        return same_carry(walk, ea, sa, eb, sb, ea.outvars.index(a))
    if walk.global_calls and ea.primitive.name in ("while", "cond"):
        return True  # (not compared, so never refused on its account)
    if walk.global_calls and (
            ea.params.get("name") in walk.global_calls
            and eb.params.get("name") == ea.params.get("name")
            or any(map(is_varying_var, ea.invars)) and not any(map(is_varying_var, ea.outvars))
            and any(map(is_varying_var, eb.invars))):
        return True  # a reduction over the replicas: the global value in both traces
    return [(x, sa, y, sb) for x, y in zip(ea.invars, eb.invars)]
