"""How a step takes its arguments, where a script fleet had not seen passed them
otherwise than as batch, state and scalars: a table that is not batch data, the
model bound outside the step (``nnx.cached_partial``, a closure), and a Python
flag the step branches on (``static_argnames``). Each against ``nnx.jit``."""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models


@pytest.fixture
def setup(make_world):
    make_world(4)
    return models.model_and_optimizer(models.LinearNet(nnx.Rngs(0)), optax.sgd(0.1), True)


_CLASSES = 16  # (a multiple of the 4 replicas: the table splits as a batch would)


def _weighted_step(lookup: str):
    """A classifier whose loss weighs each row by its class, from a table of class
    weights passed as an argument: read by index (``cw[y]``) or by a one-hot product,
    or the loss scaled by the table's mean (its output declared a mean, or not)."""
    def step(model, optimizer, x, y, cw):
        def loss_fn(m):
            ce = optax.softmax_cross_entropy_with_integer_labels(m(x), y)
            if lookup.startswith("mean"):  # (its mean, a constant scale of the loss)
                return ce.mean() * cw.mean()
            w = cw[y] if lookup == "index" else (jax.nn.one_hot(y, _CLASSES) * cw).sum(-1)
            return (ce * w).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss
    return step


@pytest.mark.parametrize("lookup, says", [
    ("one-hot", r"fails on a replica's share of it \(.*test_step_arguments\.py:\d+\): ValueError: "
                r".*the 5th argument \(16,\) as \(4,\).*batch_argnums=.*split now: \(2, 3, 4\)"),
    ("index", r"rows picked by indices that come from the batch .*the rows picked are the "
              r"5th argument's, split over the replicas as batch data.*batch_argnums="),
    ("mean", r"a value reduced over the replica's rows .* The batch arguments split into 4 or 8 "
             r"rows each: if one is not batch data .*batch_argnums="),
    ("mean, undeclared", r"the output .* is not a mean, a sum, .* The batch arguments split into "
                         r"4 or 8 rows each: if one is not batch data .*batch_argnums="),
])
def test_a_table_passed_as_an_argument_is_named_and_batch_argnums_keeps_it_whole(
        make_world, lookup, says):
    """Every array argument is batch data, split over the replicas: a table of class
    weights whose length is a multiple of the replicas splits too. The step that
    runs on one device is refused naming that argument and batch_argnums, and with
    batch_argnums=(2, 3) it trains as on one device."""
    rng = np.random.RandomState(0)
    cw = (rng.rand(_CLASSES) + 0.5).astype(np.float32)
    data = [(rng.randn(32, 6).astype(np.float32),
             rng.randint(0, _CLASSES, 32).astype(np.int32)) for _ in range(3)]
    step = _weighted_step(lookup)

    def run(call):
        model, optimizer = models.model_and_optimizer(
            nnx.Linear(6, _CLASSES, rngs=nnx.Rngs(0)), optax.sgd(0.1), call is not None)
        call = call or nnx.jit(step)
        losses = [float(call(model, optimizer, x, y, cw)) for x, y in data]
        assert fleet.check_replicas((model, optimizer)) == []
        return losses, models.flat_params(model)

    ref_losses, ref_params = run(None)
    make_world(4)
    declared = {"out_reduce": "mean"} if lookup == "mean" else {}  # (past the outputs' rule)
    with pytest.raises(fleet.FleetError, match=says) as refused:
        run(fleet.distributed_step(step, **declared))
    if lookup == "one-hot":  # (the user's line that failed, not JAX's)
        assert refused.traceback[-1].path.name == "test_step_arguments.py"
    losses, params = run(fleet.distributed_step(step, batch_argnums=(2, 3)))
    print("losses", max(abs(a - b) for a, b in zip(losses, ref_losses)),
          "params", models.max_diff(params, ref_params))
    assert np.allclose(losses, ref_losses, rtol=1e-6)
    assert models.max_diff(params, ref_params) < 1e-6


def test_nnx_cached_partial_of_a_step_trains_as_on_one_device(make_world):
    """Flax's performance guide: nnx.cached_partial(train_step, model, optimizer) caches
    the graph traversal of the objects it binds. Given a fleet step (in place of the
    nnx.jit one), it trains as the single-device cached step, the original model's
    variables updated, and traces once."""
    data = models.batches("linear", 3, 8)

    def run(wrap):
        model, optimizer = models.model_and_optimizer(
            models.LinearNet(nnx.Rngs(0)), optax.adam(models.LR), wrap)
        step = (fleet.distributed_step if wrap else nnx.jit)(models.nnx_train_step)
        cached = nnx.cached_partial(step, model, optimizer)
        losses = [float(cached(x, y)) for x, y in data]
        assert fleet.check_replicas((model, optimizer)) == []
        assert fleet.check_replicas((model, optimizer)) == []
        return losses, models.flat_params(model), step

    ref_losses, ref_params, _ = run(False)
    make_world(4)
    losses, params, step = run(True)
    print("losses", max(abs(a - b) for a, b in zip(losses, ref_losses)),
          "params", models.max_diff(params, ref_params))
    assert np.allclose(losses, ref_losses, rtol=1e-6)
    assert models.max_diff(params, ref_params) < 1e-6
    assert step.trace_count == 1


@pytest.mark.parametrize("bind, named", [
    ("functools.partial", r"functools.partial's argument 1 \(DataParallel\[LinearNet\]\), "
                          r"functools.partial's argument 2 \(DistributedOptimizer\)"),
    ("nnx.cached_partial", r"'\w+'\[0\] \(DataParallel\[LinearNet\]\), '\w+'\[1\] "
                           r"\(DistributedOptimizer\)"),
    ("closure", r"'model' \(DataParallel\[LinearNet\]\), 'optimizer' \(DistributedOptimizer\)"),
])
def test_a_step_that_binds_its_model_inside_is_refused_naming_the_objects(setup, bind, named):
    """Objects a step updates must be its arguments, as under nnx.jit (where each of
    these fails alike): the refusal names each object read from outside and says to
    pass them, or to bind the fleet step with nnx.cached_partial."""
    model, optimizer = setup

    def closure(x, y):
        return models.nnx_train_step(model, optimizer, x, y)

    inner = {"functools.partial": functools.partial, "nnx.cached_partial": nnx.cached_partial}
    fn = closure if bind == "closure" else inner[bind](models.nnx_train_step, model, optimizer)
    x, y = models.batches("linear", 1, 8)[0]
    with pytest.raises(fleet.FleetError, match=r"(?s)fails as a single-device step.*The step reads "
                       + named + r" from outside its arguments.*step\(model, optimizer, x, y\).*"
                       r"nnx.cached_partial\(fleet.distributed_step\(train_step\), model, "):
        fleet.distributed_step(fn)(x, y)


def _flagged_step(model, optimizer, x, y, train):
    """A train / eval step switched by a Python flag, as under jax.jit(static_argnames)."""
    if train:
        return models.nnx_train_step(model, optimizer, x, y)
    return models.loss_of(model(x), y)


def test_static_argnames_keeps_a_flag_static_as_jax_jit_does(make_world):
    """A Python flag the step branches on (if train:) is traced unless declared static,
    as under jax.jit: undeclared, the refusal names it and static_argnames; declared
    by name or position, the step trains and evaluates as nnx.jit(static_argnames=
    'train'), called with the flag positionally and by keyword, one program per value."""
    data = models.batches("linear", 4, 8)
    flags = [True, False, True, False]

    def run(step, wrap):
        model, optimizer = models.model_and_optimizer(
            models.LinearNet(nnx.Rngs(0)), optax.sgd(0.1), wrap)
        losses = [float(step(model, optimizer, x, y, train=train) if k % 2 else
                        step(model, optimizer, x, y, train))
                  for k, ((x, y), train) in enumerate(zip(data, flags))]
        assert fleet.check_replicas((model, optimizer)) == []
        return losses, models.flat_params(model)

    ref_losses, ref_params = run(nnx.jit(_flagged_step, static_argnames="train"), wrap=False)
    make_world(4)
    with pytest.raises(fleet.FleetError, match=r"(?s)TracerBoolConversionError.*The step's "
                       r"scalar arguments are traced, as under jax.jit: train \(the 5th "
                       r"argument\)\. .*static_argnames="):
        run(fleet.distributed_step(_flagged_step), wrap=True)
    for declared in ({"static_argnames": "train"}, {"static_argnums": 4}):
        step = fleet.distributed_step(_flagged_step, **declared)
        losses, params = run(step, wrap=True)
        print(declared, "losses", max(abs(a - b) for a, b in zip(losses, ref_losses)),
              "params", models.max_diff(params, ref_params))
        assert np.allclose(losses, ref_losses, rtol=1e-6)
        assert models.max_diff(params, ref_params) < 1e-6
        assert step.trace_count == 2  # (train=True and train=False)


@pytest.mark.parametrize("options, args, error, message", [
    ({"static_argnums": (2,), "batch_argnums": (2, 3)}, None, fleet.FleetConfigError,
     r"position\(s\) \[2\] are in both batch_argnums and static_argnums"),
    ({"static_argnums": ("x",)}, None, fleet.FleetConfigError,
     r"static_argnums=\('x',\) must be non-negative ints"),
    ({"static_argnames": (4,)}, None, fleet.FleetConfigError,
     r"static_argnames=\(4,\) must be strings"),
    ({"static_argnums": 4}, [True], fleet.FleetTypeError,
     r"the 5th argument is declared static .*but a list is not hashable"),
    ({"static_argnames": "train"}, np.ones(2, np.float32), fleet.FleetTypeError,
     r"the 5th argument is declared static .*but it is an array"),
])
def test_static_arguments_that_cannot_be_static_are_refused(setup, options, args, error, message):
    model, optimizer = setup
    x, y = models.batches("linear", 1, 8)[0]
    with pytest.raises(error, match=message):
        fleet.distributed_step(_flagged_step, **options)(model, optimizer, x, y, args)
