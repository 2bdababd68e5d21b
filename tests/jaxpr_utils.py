"""Counting collectives in a traced step."""

from collections.abc import Iterator

from jax.extend.core import jaxprs_in_params

PSUMS = ("psum", "psum_invariant")


def equations(jaxpr) -> Iterator:
    """Every equation of ``jaxpr`` (a ClosedJaxpr or Jaxpr), sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from equations(sub)


def count_primitives(jaxpr, names=PSUMS) -> int:
    """Number of equations whose primitive is one of ``names``, sub-jaxprs included."""
    return sum(eqn.primitive.name in names for eqn in equations(jaxpr))


def count_buckets(jaxpr) -> int:
    """Number of gradient buckets fleet traced (each a ``jit`` named ``fleet_bucket``)."""
    return sum(eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "fleet_bucket"
               for eqn in equations(jaxpr))


def psum_bytes(jaxpr) -> dict[str, int]:
    """Bytes of the psum operands in a jaxpr, by dtype name."""
    out: dict[str, int] = {}
    for eqn in equations(jaxpr):
        if eqn.primitive.name in PSUMS:
            for v in eqn.invars:
                name = str(v.aval.dtype)
                out[name] = out.get(name, 0) + v.aval.size * v.aval.dtype.itemsize
    return out
