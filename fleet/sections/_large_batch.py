"""Paddle's ``strategy.lars`` / ``strategy.lamb``: the user's optimizer, swapped.

Paddle replaces a Momentum optimizer with LARS and an Adam with LAMB, keeping the
user's learning rate, read back from the optimizer (``fleet.sections._hparams``).
The swapped optimizer stays injected, so ``LRScheduler`` still works.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fleet import _compat
from fleet._errors import FleetConfigError, FleetTypeError, FleetWarning
from fleet.runtime._leaves import dotted, to_host
from fleet.sections._hparams import (
    BUILD,
    INJECTED,
    OPAQUE,
    Hparams,
    TaggedTransformation,
    hparams_of,
    number,
    tag,
)

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
    coeff = number("strategy.lars_configs.lars_coeff", configs.lars_coeff, positive=True)
    decay = number("strategy.lars_configs.lars_weight_decay", configs.lars_weight_decay)
    eps = number("strategy.lars_configs.epsilon", configs.epsilon)
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
    return tag(tx, dataclasses.replace(hp, kind="lars"))


def _lamb(hp: Hparams, configs: Any) -> TaggedTransformation:
    decay = number("strategy.lamb_configs.lamb_weight_decay", configs.lamb_weight_decay)
    names = _exclude("lamb", configs.exclude_from_weight_decay)
    kwargs = dict(learning_rate=hp.learning_rate, b1=hp.b1, b2=hp.b2, eps=hp.eps,
                  eps_root=hp.eps_root, weight_decay=decay,
                  mask=decay_mask("lamb", names) if names else None)
    if hp.injected:
        tx = optax.inject_hyperparams(optax.lamb, static_args=("mask",))(**kwargs)
    else:
        tx = optax.lamb(**kwargs)
    return tag(tx, dataclasses.replace(hp, kind="lamb"))


def _wrong_inner(section: str, given: str) -> FleetConfigError:
    want, article, name, replacement = (("momentum", "a", "Momentum", "LARS") if section == "lars"
                                         else ("adam", "an", "Adam", "LAMB"))
    return FleetConfigError(
        f"strategy.{section} replaces {article} {name} optimizer with {replacement} (as Paddle "
        f"requires {name}); got {given}. Build it with {BUILD[want]} (or "
        f"{INJECTED[want]}), or turn strategy.{section} off"
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
        raise _wrong_inner(section, OPAQUE)
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
