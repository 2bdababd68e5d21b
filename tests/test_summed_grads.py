"""Raw parameters' gradients used before the distributed optimizer divides them
(``fleet.step._summed_grads``).

A functional step (raw parameters, an optax transformation given to
``fleet.distributed_optimizer``) gets gradients JAX summed over the replicas:
N times the single-device gradient until the distributed optimizer's update
divides them. Found by converting Optax-style scripts by the README: a clipping
by hand before the update (0.094 in the parameters after 4 steps on 4 CPU
devices), ``optax.global_norm(grads)`` returned (exactly 4 times one device's),
a second optimizer left plain (0.26 in its parameters) trained or reported
silently away from one device. Each is now refused at the first call, naming the
line; the clipping inside the distributed chain trains as on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fleet


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def _hand_clipped(tx):
    clip = optax.clip_by_global_norm(2.0)

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        grads, _ = clip.update(grads, clip.init(params))
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss
    return step


def _norm_returned(tx):
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, optax.global_norm(grads)
    return step


def _second_plain(tx):
    plain = optax.sgd(0.1)

    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = tx.update({"w1": grads["w1"]}, state, {"w1": params["w1"]})
        w2, _ = plain.update(grads["w2"], plain.init(params["w2"]))
        new = optax.apply_updates({"w1": params["w1"]}, updates)
        return {"w1": new["w1"], "w2": params["w2"] + w2}, state, loss
    return step


def _chained(tx):
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss
    return step


def _data(steps=3):
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(5,)), jnp.float32)}
    batches = [(rng.normal(size=(16, 3)).astype(np.float32),
                (3 * rng.normal(size=(16,))).astype(np.float32)) for _ in range(steps)]
    return params, batches


def _run(step, tx, params, batches):
    state = tx.init(params)
    outs = []
    for x, y in batches:
        params, state, out = step(params, state, x, y)
        outs.append(float(out))
    return params, outs


# name: (the step, the line the error names)
USED = {
    "a clipping by hand": (_hand_clipped, "grads, _ = clip.update"),
    "optax.global_norm(grads) returned": (_norm_returned, "optax.global_norm(grads)"),
    "a second optimizer left plain": (_second_plain, "plain.update"),
}


@pytest.mark.parametrize("name", list(USED))
def test_summed_gradients_used_before_the_distributed_optimizer_are_refused(make_world, name):
    make_world(4)
    make, _ = USED[name]
    tx = fleet.distributed_optimizer(optax.sgd(0.1))
    params, batches = _data(1)
    with pytest.raises(fleet.FleetError, match=r"uses the gradients of its raw parameters .* "
                                               r"before the distributed optimizer gets them, "
                                               r"at .*test_summed_grads.py:\d+"):
        _run(fleet.distributed_step(make(tx), batch_argnums=(2, 3)), tx, params, batches)


def test_the_line_named_is_the_use(make_world):
    """The error names the user's line that uses the sum (read back from the file)."""
    make_world(4)
    tx = fleet.distributed_optimizer(optax.sgd(0.1))
    params, batches = _data(1)
    with pytest.raises(fleet.FleetError) as err:
        _run(fleet.distributed_step(_hand_clipped(tx), batch_argnums=(2, 3)), tx, params,
             batches)
    line = int(str(err.value).split("test_summed_grads.py:")[1].split(":")[0].split(",")[0])
    with open(__file__) as f:
        assert "clip.update(grads" in f.read().splitlines()[line - 1]


def test_the_clipping_in_the_distributed_chain_trains_as_on_one_device(make_world):
    params, batches = _data()
    chain = optax.chain(optax.clip_by_global_norm(2.0), optax.sgd(0.1))
    want, want_losses = _run(jax.jit(_chained(chain)), chain, params, batches)
    make_world(4)
    tx = fleet.distributed_optimizer(chain)
    got, losses = _run(fleet.distributed_step(_chained(tx), batch_argnums=(2, 3)), tx, params,
                       batches)
    d = max(float(jnp.abs(got[k] - want[k]).max()) for k in want)
    print(f"clipped in the chain: {d:.1e} in the parameters")
    assert d < 1e-6
    assert np.allclose(losses, want_losses, atol=1e-6)
    assert fleet.check_replicas(got) == []
