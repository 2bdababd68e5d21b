"""The optimizers whose hyper-parameters fleet can read back (for ``lars`` / ``lamb``).

An optax transformation is two opaque functions, so its learning rate cannot be
read back: fleet's :func:`Momentum` and :func:`Adam` (``fleet.optimizer``) are the
optax ones tagged with the values they were built from (:class:`Hparams`). A
transformation from ``optax.inject_hyperparams(optax.sgd)`` / ``(optax.adam)`` is
recognised too (:func:`hparams_of`): its hyper-parameters sit in its state, and it
is accepted only when the same factory rebuilt from them gives bit-identical
updates on a probe (a schedule, a ``nesterov`` that LAMB lacks or any other
optimizer is refused, not guessed).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any

import numpy as np
import optax

from fleet._errors import FleetConfigError, FleetTypeError

BUILD = {
    "momentum": "fleet.optimizer.Momentum(learning_rate=0.1, momentum=0.9)",
    "adam": "fleet.optimizer.Adam(learning_rate=1e-3)",
}
INJECTED = {
    "momentum": "optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)",
    "adam": "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)",
}
OPAQUE = (
    "an optax transformation that fleet cannot read (fleet needs its learning rate, "
    "momentum or betas to build the replacement, and an optax transformation such as "
    "optax.adam(1e-3) does not expose them)"
)


@dataclasses.dataclass(frozen=True)
class Hparams:
    """What an optimizer was built from. ``kind``: ``"momentum"``, ``"adam"``,
    ``"sgd"`` (no momentum), or ``"lars"`` / ``"lamb"`` (already swapped);
    ``injected``: built by ``optax.inject_hyperparams``."""

    kind: str
    learning_rate: Any
    momentum: float = 0.0
    nesterov: bool = False
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    eps_root: float = 0.0
    injected: bool = False

    def describe(self) -> str:
        if self.kind in ("lars", "lamb"):
            return f"a {self.kind.upper()} optimizer (swapped in by strategy.{self.kind})"
        lr = "<schedule>" if callable(self.learning_rate) else f"{self.learning_rate:.6g}"
        if self.kind == "adam":
            if self.injected:
                return (f"optax.inject_hyperparams(optax.adam)(learning_rate={lr}, b1={self.b1:.6g}, "
                        f"b2={self.b2:.6g}, eps={self.eps:.6g})")
            return (f"fleet.optimizer.Adam(learning_rate={lr}, beta1={self.b1:.6g}, "
                    f"beta2={self.b2:.6g}, epsilon={self.eps:.6g})")
        if self.kind == "sgd":
            return f"optax.inject_hyperparams(optax.sgd)(learning_rate={lr}) (no momentum)"
        args = f"learning_rate={lr}, momentum={self.momentum:.6g}"
        if self.nesterov:
            args += ", nesterov=True" if self.injected else ", use_nesterov=True"
        return (f"optax.inject_hyperparams(optax.sgd)({args})" if self.injected
                else f"fleet.optimizer.Momentum({args})")


class TaggedTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation that carries ``fleet_hparams`` (:class:`Hparams`)."""

    fleet_hparams: Hparams


# The ``init`` of every transformation the swap built: a wrapper that keeps it
# (fleet.distributed_optimizer's) is recognised as swapped already.
_SWAPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tag(tx: optax.GradientTransformation, hparams: Hparams) -> TaggedTransformation:
    tx = optax.with_extra_args_support(tx)
    tagged = TaggedTransformation(tx.init, tx.update)
    tagged.fleet_hparams = hparams
    if hparams.kind in ("lars", "lamb"):
        _SWAPPED[tx.init] = hparams
    return tagged


def number(what: str, value: Any, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise FleetTypeError(f"{what} must be a number, got {value!r} of type "
                             f"{type(value).__name__}")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        raise FleetConfigError(f"{what} must be a finite number {'>' if positive else '>='} 0, "
                               f"got {value}")
    return float(value)


def _learning_rate(where: str, value: Any) -> Any:
    if callable(value):
        return value
    return number(f"{where}(learning_rate=...)", value, positive=True)


def Momentum(learning_rate: float | optax.Schedule, momentum: float = 0.9,
             use_nesterov: bool = False) -> TaggedTransformation:
    """Paddle's ``Momentum``: ``optax.sgd(learning_rate, momentum, nesterov)``,
    tagged so that ``strategy.lars`` can replace it with LARS.

    Args:
        learning_rate: a positive number or an optax schedule.
        momentum: the momentum coefficient, in [0, 1).
        use_nesterov: Nesterov momentum.

    Example:
        >>> tx = Momentum(learning_rate=0.1, momentum=0.9)
        >>> tx.fleet_hparams.momentum
        0.9
    """
    learning_rate = _learning_rate("fleet.optimizer.Momentum", learning_rate)
    momentum = number("fleet.optimizer.Momentum(momentum=...)", momentum)
    if momentum >= 1:
        raise FleetConfigError(f"fleet.optimizer.Momentum(momentum={momentum}) must be below 1 "
                               "(0.9 is the usual value)")
    if not isinstance(use_nesterov, bool):
        raise FleetTypeError(f"fleet.optimizer.Momentum(use_nesterov=...) must be a bool, got "
                             f"{use_nesterov!r}")
    return tag(optax.sgd(learning_rate, momentum, use_nesterov),
                Hparams("momentum", learning_rate, momentum=momentum, nesterov=use_nesterov))


def Adam(learning_rate: float | optax.Schedule, beta1: float = 0.9,
         beta2: float = 0.999, epsilon: float = 1e-8) -> TaggedTransformation:
    """Paddle's ``Adam``: ``optax.adam(learning_rate, beta1, beta2, epsilon)``,
    tagged so that ``strategy.lamb`` can replace it with LAMB.

    Args:
        learning_rate: a positive number or an optax schedule.
        beta1, beta2: the moment decay rates, in [0, 1).
        epsilon: added to the denominator (Paddle's and optax's default: 1e-8).

    Example:
        >>> tx = Adam(learning_rate=1e-3)
        >>> tx.fleet_hparams.b2
        0.999
    """
    learning_rate = _learning_rate("fleet.optimizer.Adam", learning_rate)
    betas = {}
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        betas[name] = number(f"fleet.optimizer.Adam({name}=...)", value)
        if betas[name] >= 1:
            raise FleetConfigError(f"fleet.optimizer.Adam({name}={value}) must be below 1")
    epsilon = number("fleet.optimizer.Adam(epsilon=...)", epsilon)
    return tag(optax.adam(learning_rate, betas["beta1"], betas["beta2"], epsilon),
                Hparams("adam", learning_rate, b1=betas["beta1"], b2=betas["beta2"],
                        eps=epsilon))


# -- Recognising optax.inject_hyperparams(optax.sgd / optax.adam) -----------------------

_PROBE_PARAMS = {"w": np.array([0.5, -1.5, 2.0], np.float32)}
_PROBE_GRADS = [{"w": np.array(g, np.float32)}
                for g in ([0.3, -1.0, 2.0], [-0.7, 0.2, 1.5], [0.05, 0.9, -3.0])]
_CANDIDATES = {  # hyper-parameter names -> (kind, factory, nesterov values to try)
    frozenset({"learning_rate"}): ("sgd", optax.sgd, (False,)),
    frozenset({"learning_rate", "momentum"}): ("momentum", optax.sgd, (False, True)),
    frozenset({"learning_rate", "b1", "b2", "eps", "eps_root"}): ("adam", optax.adam, (False,)),
}


def _run_probe(tx: optax.GradientTransformation) -> list[np.ndarray]:
    tx = optax.with_extra_args_support(tx)
    state = tx.init(_PROBE_PARAMS)
    out = []
    for grads in _PROBE_GRADS:
        updates, state = tx.update(grads, state, _PROBE_PARAMS)
        out.append(np.asarray(updates["w"]))
    return out


def _injected_hparams(tx: optax.GradientTransformation) -> Hparams | None:
    """The hyper-parameters of an injected ``optax.sgd`` / ``optax.adam``, or None."""
    try:
        state = tx.init(_PROBE_PARAMS)
    except Exception:  # a transformation that needs other parameters
        return None
    if not isinstance(state, (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)):
        return None
    if getattr(state, "hyperparams_states", None):  # a scheduled hyper-parameter
        return None
    found = _CANDIDATES.get(frozenset(state.hyperparams))
    if found is None:
        return None
    kind, factory, nesterovs = found
    values = {k: float(v) for k, v in state.hyperparams.items()}
    try:
        expected = _run_probe(tx)
    except Exception:  # not an sgd or adam after all
        return None
    for nesterov in nesterovs:
        extra = {"nesterov": True} if nesterov else {}
        got = _run_probe(optax.inject_hyperparams(factory)(**values, **extra))
        if all(np.array_equal(a, b) for a, b in zip(expected, got)):
            return Hparams(kind, values["learning_rate"], nesterov=nesterov, injected=True,
                           **{k: v for k, v in values.items() if k != "learning_rate"})
    return None


def hparams_of(tx: Any) -> Hparams | None:
    """What ``tx`` was built from, or None when fleet cannot tell."""
    tagged = getattr(tx, "fleet_hparams", None)
    if isinstance(tagged, Hparams):
        return tagged
    try:
        swapped = _SWAPPED.get(getattr(tx, "init", None))
    except TypeError:  # no init, or one that cannot be weakly referenced
        swapped = None
    if swapped is not None:
        return swapped
    inner = getattr(tx, "inner", None)  # a distributed transformation (fleet.wrappers._distributed_optimizer)
    if inner is not None:
        return hparams_of(inner)
    if isinstance(tx, optax.GradientTransformation):
        return _injected_hparams(tx)
    return None
