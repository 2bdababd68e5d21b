"""What a ``fleet.CheckpointManager`` call takes: the parts of a training state,
read from live objects and put back, and the call's other checks.

:class:`Contents` is the one list of the parts (its docstring says what each may
be): ``save``, ``restore`` and ``restore_latest`` take them as keywords, through
it. An array part (:class:`Part`) is a live object's leaves by dotted path: NNX
objects are restored in place, pytrees (``state``, ``rng``) come back as new
values laid out like the ones given. The JSON part holds step, epoch, the
loader's position, the user's metadata and the PRNG implementations of key
leaves. Restoring checks every part first and changes nothing when anything
differs.

Every collective call first meets the other processes (:func:`meet`, through
:func:`fleet.runtime._agree.agree`): a process that does not make the call ends
them within ``FLEET_AGREE_TIMEOUT`` seconds (60) with an error naming the call
and the missing ranks, instead of a hang in orbax's barriers.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from fleet.checkpoint import _tree
from fleet.checkpoint._errors import FleetCheckpointError
from fleet.comm._shard_comm import to_logical, to_shards
from fleet.runtime import _agree
from fleet.runtime._leaves import module_variables
from fleet.sections import _sharding


@dataclasses.dataclass
class Part:
    """One array part: a live object's leaves by dotted path."""

    name: str
    obj: Any
    leaves: dict[str, Any]
    treedef: Any = None  # a pytree part (rebuilt on restore)
    variables: dict[str, nnx.Variable] | None = None  # an NNX part (set in place)
    # strategy.sharding: the sharded leaves' layouts; they are saved and restored
    # in their logical (unsharded) layout, so any replica count can read them.
    layouts: dict[str, Any] = dataclasses.field(default_factory=dict)
    # a checkpoint of an earlier fleet: {key: the key it was written under}
    # (fleet.checkpoint._migrate); read under that key, put back under this one.
    stored_as: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, name: str, obj: Any) -> Part:
        if isinstance(obj, nnx.Pytree):
            variables = module_variables(obj)
            layouts = {k: lay for k, v in variables.items()
                       if (lay := _sharding.layout_of(v)) is not None}
            leaves = {k: to_logical(v.get_raw_value(), layouts[k]) if k in layouts
                      else v.get_value() for k, v in variables.items()}
            return cls(name, obj, leaves, variables=variables, layouts=layouts)
        try:
            leaves, treedef = _tree.flatten(obj)
        except ValueError as e:
            raise FleetCheckpointError(f"{name}: {e}") from None
        layouts = {k: v.layout for k, v in leaves.items() if _sharding.is_shard(v)}
        leaves = {k: to_logical(v.value, v.layout) if _sharding.is_shard(v) else v
                  for k, v in leaves.items()}
        bad = [k for k, v in leaves.items()
               if not isinstance(v, (jax.Array, np.ndarray, np.generic, int, float, bool))]
        if bad:
            raise FleetCheckpointError(
                f"{name}={type(obj).__name__}: leaf {bad[0]!r} is a "
                f"{type(leaves[bad[0]]).__name__}; {name} must be an NNX object or a "
                "pytree of arrays and numbers (a TrainState, a dict of parameters, a key)"
            )
        return cls(name, obj, leaves, treedef=treedef, layouts=layouts)

    def signatures(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: _tree.signature(v) for k, v in self.leaves.items()}

    def impls(self) -> dict[str, str]:
        return _tree.key_impls(self.leaves)

    def to_save(self) -> dict[str, Any]:
        """What orbax writes: global arrays as they are, host values as numpy copies
        (process 0's are written)."""
        return _tree.stored(self.leaves)

    def targets(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(items, restore args)`` for orbax's ``PyTreeRestore``."""
        pairs = {self.stored_as.get(k, k): _tree.target(v) for k, v in self.leaves.items()}
        return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}

    def put(self, values: dict[str, jax.Array]) -> Any:
        """Puts restored ``values`` back: NNX variables in place; returns the object
        (a new pytree for a pytree part)."""
        new = {k: _tree.restored(values[self.stored_as.get(k, k)], leaf)
               for k, leaf in self.leaves.items()}
        for key, layout in self.layouts.items():
            new[key] = to_shards(new[key], layout)
            if self.variables is None:
                new[key] = _sharding.Shard(new[key], layout)
        if self.variables is not None:
            for key, var in self.variables.items():  # (a sharded leaf holds its slices)
                if key in self.layouts:
                    var.set_raw_value(new[key])
                else:
                    var.set_value(new[key])
            return self.obj
        return jax.tree_util.tree_unflatten(self.treedef, list(new.values()))


# --------------------------------------------------------------------------- what a checkpoint holds


@dataclasses.dataclass(frozen=True, eq=False)
class Contents:
    """What a checkpoint holds: the objects ``save`` reads and ``restore`` fills,
    each given as a keyword (``None``: not saved, or not restored).

    Attributes:
        model: an NNX model (``fleet.DataParallel`` or plain): every variable,
            parameters, batch-norm statistics and RNG streams alike; restored in place.
        optimizer: an ``nnx.Optimizer`` (``fleet.DistributedOptimizer``); restored
            in place.
        state: any pytree of arrays (a Linen ``TrainState``); restored as a new value.
        rng: a PRNG key or a pytree of keys the script carries; restored as new keys.
        loader: a ``fleet.io.DataLoader`` or batch sampler: its position (JSON), so
            a restored job continues with the very next batch; restored in place.
    """

    model: Any = None
    optimizer: Any = None
    state: Any = None
    rng: Any = None
    loader: Any = None

    @classmethod
    def of(cls, call: str, objects: dict[str, Any]) -> Contents:
        """The keyword objects given to ``CheckpointManager.<call>``; another keyword
        is a ``TypeError``, as Python raises for any function."""
        for name in objects:
            if name not in _NAMES:
                raise TypeError(
                    f"CheckpointManager.{call}() got an unexpected keyword argument {name!r}")
        return cls(**objects)

    def parts(self) -> dict[str, Part]:
        """The array parts given, by name (the loader's position is JSON, no array part)."""
        return {name: Part.of(name, obj) for name in ARRAY_PARTS
                if (obj := getattr(self, name)) is not None}


_NAMES = tuple(field.name for field in dataclasses.fields(Contents))
#: The parts stored as arrays, one orbax item each.
ARRAY_PARTS = tuple(name for name in _NAMES if name != "loader")


def takes_contents(method: Callable) -> Callable:
    """Shows :class:`Contents`'s fields as keyword-only parameters of ``method``
    (``help``, ``inspect.signature``), in place of its ``**objects``."""
    signature = inspect.signature(method)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    at = next((i for i, p in enumerate(params) if p.kind is p.KEYWORD_ONLY), len(params))
    fields = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                annotation="Any") for name in _NAMES]
    method.__signature__ = signature.replace(parameters=params[:at] + fields + params[at:])
    return method


# --------------------------------------------------------------------------- a call's other checks


def _number(name: str, value: Any, least: int) -> int:
    """``value``, an int (or a numpy one) of at least ``least``; else raises."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        allowed = "an int >= 1 or None" if name != "step" else "an int >= 0"
        raise FleetCheckpointError(f"{name} must be {allowed}, got {value!r}")
    return int(value)


def positive(name: str, value: Any) -> int | None:
    return None if value is None else _number(name, value, 1)


def step_number(step: Any) -> int:
    if isinstance(step, jax.Array) and step.ndim == 0:
        step = int(np.asarray(step.addressable_shards[0].data))
    return _number("step", step, 0)


def meet(call: str, value: Any) -> None:
    """Every process makes ``call`` with the same ``value`` (a bounded wait)."""
    if jax.process_count() == 1:
        return
    name = f"fleet.CheckpointManager.{call}" if call != "__init__" else "fleet.CheckpointManager()"
    got = _agree.agree(name, json.dumps(value))
    if any(g != got[0] for g in got):
        raise FleetCheckpointError(
            f"{name}: the processes made this call with different arguments ("
            + "; ".join(f"rank {r}: {g}" for r, g in enumerate(got))
            + "); every process must make the same calls"
        )


# --------------------------------------------------------------------------- loader


def loader_state(loader: Any) -> dict[str, Any]:
    if not callable(getattr(loader, "state_dict", None)):
        raise FleetCheckpointError(
            f"loader={type(loader).__name__} has no state_dict(); pass a fleet.io.DataLoader "
            "or a batch sampler (anything with state_dict() / set_state_dict())"
        )
    return jsonable(loader.state_dict(), "loader.state_dict()")


def loader_problems(loader: Any, state: Any) -> list[str]:
    """Why ``state`` does not fit ``loader``, tried on a copy of its batch sampler
    (the loader itself is left alone)."""
    if state is None:
        return ["loader: the checkpoint holds no loader position (saved without loader=)"]
    sampler = getattr(loader, "batch_sampler", None)
    probe, probe_state = (sampler, state.get("sampler")) if sampler is not None else (loader, state)
    if not callable(getattr(probe, "set_state_dict", None)):
        return []
    if probe_state is None:
        return [f"loader: the checkpoint's position {state} is not a batch sampler's position"]
    try:
        copy.copy(probe).set_state_dict(probe_state)
    except Exception as e:  # noqa: BLE001 - the sampler's own message says what differs
        return [f"loader: {e}"]
    return []


# --------------------------------------------------------------------------- metadata


def jsonable(value: Any, where: str) -> Any:
    """``value`` as plain JSON data (numpy scalars become Python numbers, tuples
    lists); raises, naming the first offending entry, for anything else."""
    if value is None or isinstance(value, (bool, str, int, float)):
        return value  # (json writes NaN and Infinity, and reads them back)
    if isinstance(value, np.generic) and value.ndim == 0 and value.dtype.kind in "biuf":
        return value.item()
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise FleetCheckpointError(
                f"{where} has the key {bad[0]!r} ({type(bad[0]).__name__}); JSON keys are "
                "strings: use str keys"
            )
        return {k: jsonable(v, f"{where}[{k!r}]") for k, v in value.items()}
    raise FleetCheckpointError(
        f"{where} is a {type(value).__name__}; metadata is stored as JSON (never pickled), "
        "so it may hold dicts with str keys, lists, str, int, float, bool and None; "
        "convert it (e.g. .tolist()), or save arrays through model=, state= or rng="
    )

