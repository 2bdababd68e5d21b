"""Paddle's ``strategy.lars`` / ``strategy.lamb``: the user's optimizer, swapped.

Paddle replaces a Momentum optimizer with LARS and an Adam with LAMB, keeping the
user's learning rate. An optax transformation is two opaque functions, so its
learning rate cannot be read back: fleet's :func:`Momentum` and :func:`Adam` are
the optax ones tagged with the values they were built from. A transformation
from ``optax.inject_hyperparams(optax.sgd)`` / ``(optax.adam)`` is recognised
too: its hyper-parameters sit in its state, and it is accepted only when the
same factory rebuilt from them gives bit-identical updates on a probe (a
schedule, a ``nesterov`` that LAMB lacks or any other optimizer is refused, not
guessed). The swapped optimizer stays injected, so ``LRScheduler`` still works.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fleet import _compat
from fleet._errors import FleetConfigError, FleetTypeError, FleetWarning
from fleet.runtime._leaves import dotted, to_host

_BUILD = {
    "momentum": "fleet.optimizer.Momentum(learning_rate=0.1, momentum=0.9)",
    "adam": "fleet.optimizer.Adam(learning_rate=1e-3)",
}
_INJECTED = {
    "momentum": "optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)",
    "adam": "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)",
}
_OPAQUE = (
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


def _tag(tx: optax.GradientTransformation, hparams: Hparams) -> TaggedTransformation:
    tx = optax.with_extra_args_support(tx)
    tagged = TaggedTransformation(tx.init, tx.update)
    tagged.fleet_hparams = hparams
    if hparams.kind in ("lars", "lamb"):
        _SWAPPED[tx.init] = hparams
    return tagged


def _number(what: str, value: Any, positive: bool = False) -> float:
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
    return _number(f"{where}(learning_rate=...)", value, positive=True)


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
    momentum = _number("fleet.optimizer.Momentum(momentum=...)", momentum)
    if momentum >= 1:
        raise FleetConfigError(f"fleet.optimizer.Momentum(momentum={momentum}) must be below 1 "
                               "(0.9 is the usual value)")
    if not isinstance(use_nesterov, bool):
        raise FleetTypeError(f"fleet.optimizer.Momentum(use_nesterov=...) must be a bool, got "
                             f"{use_nesterov!r}")
    return _tag(optax.sgd(learning_rate, momentum, use_nesterov),
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
        betas[name] = _number(f"fleet.optimizer.Adam({name}=...)", value)
        if betas[name] >= 1:
            raise FleetConfigError(f"fleet.optimizer.Adam({name}={value}) must be below 1")
    epsilon = _number("fleet.optimizer.Adam(epsilon=...)", epsilon)
    return _tag(optax.adam(learning_rate, betas["beta1"], betas["beta2"], epsilon),
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


# -- The swap ---------------------------------------------------------------------------

def _exclude(section: str, names: Any) -> tuple[str, ...]:
    where = f"strategy.{section}_configs.exclude_from_weight_decay"
    if isinstance(names, str) or not isinstance(names, (tuple, list)):
        raise FleetTypeError(f"{where} must be a list of parameter-name substrings, got "
                             f"{names!r}; e.g. ['bias', 'norm']")
    for name in names:
        if not isinstance(name, str) or not name:
            raise FleetConfigError(
                f"{where} holds {name!r}; each entry must be a non-empty string matched "
                "against the parameters' dotted names (e.g. 'bias' matches 'linear1.bias')")
    return tuple(names)


def decay_mask(section: str, names: tuple[str, ...]) -> Callable[[Any], Any]:
    """``params -> bool tree``: False (no weight decay) for a parameter whose
    dotted name contains one of ``names``. An entry that matches no parameter
    is reported once with a FleetWarning."""
    reported = []

    def mask(params: Any) -> Any:
        flat, treedef = jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        paths = [dotted(p) for p, _ in flat]
        unused = [n for n in names if not any(n in p for p in paths)]
        if unused and not reported:
            reported.append(True)
            warnings.warn(
                f"strategy.{section}_configs.exclude_from_weight_decay entries {unused} "
                f"match no parameter (names: {', '.join(paths[:8])}"
                f"{', ...' if len(paths) > 8 else ''}); those entries exclude nothing",
                FleetWarning, stacklevel=2)
        return jax.tree_util.tree_unflatten(
            treedef, [not any(n in p for n in names) for p in paths])

    return mask


def _lars(hp: Hparams, configs: Any) -> TaggedTransformation:
    coeff = _number("strategy.lars_configs.lars_coeff", configs.lars_coeff, positive=True)
    decay = _number("strategy.lars_configs.lars_weight_decay", configs.lars_weight_decay)
    eps = _number("strategy.lars_configs.epsilon", configs.epsilon)
    names = _exclude("lars", configs.exclude_from_weight_decay)
    kwargs = dict(learning_rate=hp.learning_rate, weight_decay=decay,
                  weight_decay_mask=decay_mask("lars", names) if names else True,
                  trust_coefficient=coeff, eps=eps, trust_ratio_mask=True,
                  momentum=hp.momentum, nesterov=hp.nesterov)
    if hp.injected:
        tx = optax.inject_hyperparams(
            optax.lars, static_args=("weight_decay_mask", "trust_ratio_mask"))(**kwargs)
    else:
        tx = optax.lars(**kwargs)
    return _tag(tx, dataclasses.replace(hp, kind="lars"))


def _lamb(hp: Hparams, configs: Any) -> TaggedTransformation:
    decay = _number("strategy.lamb_configs.lamb_weight_decay", configs.lamb_weight_decay)
    names = _exclude("lamb", configs.exclude_from_weight_decay)
    kwargs = dict(learning_rate=hp.learning_rate, b1=hp.b1, b2=hp.b2, eps=hp.eps,
                  eps_root=hp.eps_root, weight_decay=decay,
                  mask=decay_mask("lamb", names) if names else None)
    if hp.injected:
        tx = optax.inject_hyperparams(optax.lamb, static_args=("mask",))(**kwargs)
    else:
        tx = optax.lamb(**kwargs)
    return _tag(tx, dataclasses.replace(hp, kind="lamb"))


def _wrong_inner(section: str, given: str) -> FleetConfigError:
    want, article, name, replacement = (("momentum", "a", "Momentum", "LARS") if section == "lars"
                                         else ("adam", "an", "Adam", "LAMB"))
    return FleetConfigError(
        f"strategy.{section} replaces {article} {name} optimizer with {replacement} (as Paddle "
        f"requires {name}); got {given}. Build it with {_BUILD[want]} (or "
        f"{_INJECTED[want]}), or turn strategy.{section} off"
    )


def swap_tx(tx: Any, strategy: Any) -> Any:
    """``tx`` with ``strategy.lars`` / ``strategy.lamb`` applied.

    With neither on, ``tx`` itself. With ``lars``, a Momentum optimizer becomes
    ``optax.lars`` (``lars_configs``: ``lars_coeff`` -> ``trust_coefficient``,
    ``lars_weight_decay`` -> ``weight_decay``, ``epsilon`` -> ``eps``, the
    momentum and nesterov kept); with ``lamb``, an Adam becomes ``optax.lamb``
    (``lamb_weight_decay`` -> ``weight_decay``, the betas and eps kept). The
    learning rate is kept; ``exclude_from_weight_decay`` names parameters that
    get no weight decay. An optimizer already swapped (also inside
    ``fleet.distributed_optimizer``'s wrapper) is returned as it is.

    Raises:
        FleetConfigError: both sections on; an inner optimizer of another kind
            or one whose hyper-parameters fleet cannot read; a bad config value.

    Example:
        >>> s = fleet.DistributedStrategy(); s.lars = True  # doctest: +SKIP
        >>> swap_tx(Momentum(0.1), s)  # optax.lars(0.1, weight_decay=5e-4, ...)
    """
    lars, lamb = strategy.lars, strategy.lamb
    if not (lars or lamb):
        return tx
    if lars and lamb:
        raise FleetConfigError(
            "strategy.lars and strategy.lamb are both on; each replaces a different "
            "optimizer (LARS a Momentum, LAMB an Adam): turn one of them off")
    section = "lars" if lars else "lamb"
    hp = hparams_of(tx)
    if hp is not None and hp.kind == section:
        return tx
    if hp is None:
        raise _wrong_inner(section, _OPAQUE)
    if hp.kind != ("momentum" if lars else "adam"):
        raise _wrong_inner(section, hp.describe())
    return _lars(hp, strategy.lars_configs) if lars else _lamb(hp, strategy.lamb_configs)


# -- An nnx.Optimizer's state for the swapped transformation ---------------------------

def _params_like(state: Any) -> Any:
    """The first params-shaped tree in an optax state: sgd's momentum trace or
    Adam's first moment (looked for through tuples and injected states)."""
    if isinstance(state, optax.TraceState):
        return state.trace
    if isinstance(state, optax.ScaleByAdamState):
        return state.mu
    if isinstance(state, (tuple, list)):
        for item in state:
            found = _params_like(item)
            if found is not None:
                return found
    if isinstance(state, dict):
        return _params_like(tuple(state.values()))
    return None


def swap_optimizer_state(optimizer: nnx.Optimizer, new_tx: Any) -> None:
    """Makes ``optimizer`` use ``new_tx``: its ``tx`` and a fresh ``opt_state``,
    as ``nnx.Optimizer(model, new_tx, wrt=...)`` would build them.

    An ``nnx.Optimizer`` holds no model, so the parameters' shapes come from
    its current state (a momentum trace or Adam's first moment). Call it before
    the optimizer is placed on the mesh, and before it takes a step.

    Raises:
        FleetConfigError: the optimizer has stepped already (its state would be
            lost), or its state holds nothing shaped like the parameters.

    Example:
        >>> opt = nnx.Optimizer(model, Momentum(0.1), wrt=nnx.Param)  # doctest: +SKIP
        >>> swap_optimizer_state(opt, swap_tx(opt.tx, strategy))
    """
    if new_tx is optimizer.tx:
        return
    steps = int(to_host(optimizer.step.get_value()))
    if steps:
        raise FleetConfigError(
            f"the optimizer has taken {steps} steps already; its state cannot carry over "
            "to the optimizer the strategy swaps in. Call fleet.distributed_optimizer on it "
            "before training (or build nnx.Optimizer(model, fleet.distributed_optimizer(tx), "
            "wrt=nnx.Param))")
    like = _params_like(optimizer.opt_state)
    if like is None:
        raise FleetConfigError(
            "the optimizer's state holds nothing shaped like the parameters (a plain SGD "
            "without momentum?), so fleet cannot build the swapped optimizer's state from "
            "it. Build the optimizer with fleet.optimizer.Momentum(learning_rate=0.1, "
            "momentum=0.9) or fleet.optimizer.Adam(learning_rate=1e-3), or build "
            "nnx.Optimizer(model, fleet.distributed_optimizer(tx), wrt=nnx.Param)")
    zeros = jax.tree.map(jnp.zeros_like, like)
    optimizer.tx = new_tx
    optimizer.opt_state = nnx.data(_compat.to_opt_state(new_tx.init(zeros)))
