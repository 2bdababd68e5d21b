"""Counting collectives in a traced step."""

from jax.extend.core import jaxprs_in_params


def count_primitives(jaxpr, names=("psum", "psum_invariant")) -> int:
    """Number of equations whose primitive is one of ``names``, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in names:
            total += 1
        for sub in jaxprs_in_params(eqn.params):
            total += count_primitives(sub, names)
    return total


def count_buckets(jaxpr) -> int:
    """Number of gradient buckets fleet traced (each a ``jit`` named ``fleet_bucket``)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "fleet_bucket":
            total += 1
        for sub in jaxprs_in_params(eqn.params):
            total += count_buckets(sub)
    return total
