"""An ensemble built with ``nnx.vmap``, as Flax's transforms guide builds one: its
members see the whole batch (``in_axes=(0, None)``), so its outputs are laid out
``(members, rows, ...)``, the batch rows on axis 1.

Before, fleet read a reduction over the rows only on the leading axis: the
guide's loss, ``ce.mean()`` over the ``(members, rows)`` losses, was refused as
"a reduce_sum over several axes that grow with the batch", and an output of the
members' logits was described with the global batch's shape "per replica". Now
the rows' axis is the one that grows with the batch, wherever it is
(``fleet.semantics._outputs_walk``): the ensemble trains as on one device, with
dropout and synced batch norm inside its members; a loss that mixes the rows
along axis 1, or sums over them, stays refused; an output with the rows on axis
1 is refused naming the axis and ``jnp.moveaxis``, which fleet gathers as on one
device; a declared ``'gather'`` of it is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleet
from tests import models

MEMBERS = 3


class Member(nnx.Module):
    def __init__(self, layers: str, rngs: nnx.Rngs):
        self.l1, self.l2 = nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.9, rngs=rngs) if "bn" in layers else None
        self.drop = nnx.Dropout(0.3, rngs=rngs) if "dropout" in layers else None

    def __call__(self, x):
        h = self.l1(x)
        h = self.bn(h) if self.bn is not None else h
        h = self.drop(h) if self.drop is not None else h
        return self.l2(nnx.relu(h))


class Ensemble(nnx.Module):
    def __init__(self, layers: str, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=MEMBERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return Member(layers, rngs)

        self.members = create(rngs)

    def __call__(self, x):
        return nnx.vmap(lambda m, x: m(x), in_axes=(0, None), out_axes=0)(self.members, x)


def make(layers: str = ""):
    model = Ensemble(layers, nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def losses(model, x, y):
    logits = model(x)  # (members, rows, classes)
    return logits, optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.broadcast_to(y, logits.shape[:2]))


LOSSES = {
    "ce.mean()": lambda ce: ce.mean(),
    "ce.mean(axis=1).mean()": lambda ce: ce.mean(axis=1).mean(),
    "ce.mean(axis=0).mean()": lambda ce: ce.mean(axis=0).mean(),
}


def step_for(loss_form: str, out: str = "rows first"):
    def step(model, optimizer, x, y):
        def loss_fn(m):
            logits, ce = losses(m, x, y)
            return LOSSES[loss_form](ce), logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        accuracy = (logits.mean(0).argmax(-1) == y).mean()
        return loss, accuracy, (jnp.moveaxis(logits, 1, 0) if out == "rows first" else logits)

    return step


def data(steps: int = 3):
    rs = np.random.RandomState(0)
    return [(rs.randn(16, 3).astype(np.float32), rs.randint(0, 2, 16).astype(np.int32))
            for _ in range(steps)]


def strategy():
    s = fleet.DistributedStrategy()
    s.sync_batch_norm = True
    return s


def one_device_and_fleet(step, layers: str, make_world):
    """``step`` over :func:`data` on one device, then with fleet on 4: fleet's
    outputs per call, its model and optimizer, and the largest differences of the
    outputs and of the parameters."""
    batches = data()
    model, optimizer = make(layers)
    single = nnx.jit(step)
    want = [single(model, optimizer, *b) for b in batches]
    make_world(4, strategy())
    got_model, got_optimizer = make(layers)
    got_model = fleet.distributed_model(got_model)
    got_optimizer = fleet.distributed_optimizer(got_optimizer)
    fleet_step = fleet.distributed_step(step)
    got = [fleet_step(got_model, got_optimizer, *b) for b in batches]
    outputs = models.max_diff(dict(enumerate(jax.tree.leaves(want))),
                              dict(enumerate(jax.tree.leaves(got))))
    params = models.max_diff(models.flat_params(got_model), models.flat_params(model))
    return got, (got_model, got_optimizer), outputs, params


@pytest.mark.parametrize("loss_form,layers", [("ce.mean()", "bn dropout"),
                                              ("ce.mean(axis=1).mean()", ""),
                                              ("ce.mean(axis=0).mean()", "bn")])
def test_the_guides_ensemble_trains_as_on_one_device(make_world, loss_form, layers):
    got, (got_model, _), outputs, params = one_device_and_fleet(
        step_for(loss_form), layers, make_world)
    print(f"{loss_form} {layers or 'linear'}: outputs {outputs:.2e}, parameters {params:.2e}")
    assert jax.tree.leaves(got)[2].shape == (16, MEMBERS, 2)  # the logits, gathered
    assert outputs < 1e-5 and params < 1e-6
    assert fleet.check_replicas(got_model) == []


def refused_step(form: str):
    def step(model, optimizer, x, y):
        def loss_fn(m):
            _, ce = losses(m, x, y)
            if form == "centred over the rows":
                return ((ce - ce.mean(axis=1, keepdims=True)) ** 2).mean()
            return ce.sum(axis=1).mean()  # "summed over the rows"

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return step


@pytest.mark.parametrize("form,error", [
    ("centred over the rows", r"the step combines different rows of its batch"),
    ("summed over the rows", r"the output is a sum over the batch rows"),
])
def test_losses_that_mix_or_sum_the_rows_on_axis_1_stay_refused(make_world, form, error):
    make_world(4)
    model, optimizer = make()
    step = fleet.distributed_step(refused_step(form))
    with pytest.raises(fleet.FleetError, match=error):
        step(fleet.distributed_model(model), fleet.distributed_optimizer(optimizer), *data(1)[0])


def test_an_output_with_the_rows_on_axis_1_is_refused_naming_moveaxis(make_world):
    make_world(4)
    model, optimizer = make()
    model, optimizer = fleet.distributed_model(model), fleet.distributed_optimizer(optimizer)
    step = fleet.distributed_step(step_for("ce.mean()", out="members first"))
    with pytest.raises(fleet.FleetError, match=(
            r"output 2 \(shape \(3, 16, 2\) for 16 batch rows\) .*Its batch rows are its "
            r"axis 1 .*jnp.moveaxis\(out, 1, 0\)")):
        step(model, optimizer, *data(1)[0])
    declared = fleet.distributed_step(step_for("ce.mean()", out="members first"),
                                      out_reduce=(None, None, "gather"))
    with pytest.raises(fleet.FleetConfigError, match=(
            r"out_reduce asks to gather output 2, of shape \(3, 16, 2\) for 16 batch rows.*"
            r"jnp.moveaxis\(out, 1, 0\)")):
        declared(model, optimizer, *data(1)[0])


def per_member_step(model, optimizer, x, y):
    """The guide's loss, and each member's own: its mean loss and its accuracy
    (means), how often it predicts each class (sums) and its largest logit
    (maxima), arrays of shape (members,) or (members, classes) (returned
    undeclared they were refused as "neither a scalar nor per example")."""
    def loss_fn(m):
        logits, ce = losses(m, x, y)
        return ce.mean(), (ce.mean(axis=1), logits)

    (loss, (member_losses, logits)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    member_accuracy = (logits.argmax(-1) == y).mean(axis=1)
    predicted = jax.nn.one_hot(logits.argmax(-1), 2).sum(axis=1)  # (members, classes): sums
    return loss, member_losses, member_accuracy, predicted, logits.max(axis=(1, 2))


def test_per_member_outputs_combine_element_by_element_as_on_one_device(make_world):
    """An output none of whose axes is the batch rows is read element by element as
    a scalar is: each member's mean loss and accuracy is a mean over the rows, so
    the mean over the replicas, its class counts the sum, its largest logit the
    maximum; a per-member standard deviation has no combination and is refused,
    naming its shape."""
    got, (got_model, got_optimizer), outputs, params = one_device_and_fleet(
        per_member_step, "dropout", make_world)
    print(f"per-member outputs {outputs:.2e}, parameters {params:.2e}")
    assert [np.shape(x) for x in got[0]] == [(), (MEMBERS,), (MEMBERS,), (MEMBERS, 2),
                                             (MEMBERS,)]
    assert outputs < 1e-6 and params < 1e-6
    assert fleet.check_replicas((got_model, got_optimizer)) == []

    def spread(model, optimizer, x, y):
        return losses(model, x, y)[1].std(axis=1)

    with pytest.raises(fleet.FleetError, match=r"the output \(a float32 array of shape \(3,\) "
                                               r"that differs across replicas\) is not a mean"):
        fleet.distributed_step(spread)(got_model, got_optimizer, *data(1)[0])
