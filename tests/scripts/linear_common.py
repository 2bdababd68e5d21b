"""The seeds' LinearNet, its data, and three ways to train it: fleet (any launcher),
and the single-card reference. Shared by the launcher tests and their worker scripts."""

from __future__ import annotations

import numpy as np

STEPS = 8
GLOBAL_BATCH = 16  # divisible by 1, 2, 4 and 8 replicas


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((GLOBAL_BATCH, 10)).astype(np.float32)
    y = rng.standard_normal((GLOBAL_BATCH, 1)).astype(np.float32)
    return x, y


def _model():
    from flax import nnx

    class LinearNet(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self._linear1 = nnx.Linear(10, 10, rngs=rngs)
            self._linear2 = nnx.Linear(10, 1, rngs=rngs)

        def __call__(self, x):
            return self._linear2(self._linear1(x))

    return LinearNet(nnx.Rngs(0))


def params(model) -> dict[str, np.ndarray]:
    """The parameters by dotted path, as host arrays (from this process's first shard)."""
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    out = {}
    for path, var in flat:
        value = var.get_value()
        if hasattr(value, "addressable_shards"):
            value = value.addressable_shards[0].data
        out[".".join(map(str, path))] = np.asarray(value)
    return out


def train_fleet(steps: int = STEPS) -> dict[str, np.ndarray]:
    """The four-step fleet version; each process passes its rows of each global batch."""
    import optax
    from flax import nnx

    import fleet

    fleet.init(is_collective=True)
    model = fleet.distributed_model(_model())
    optimizer = fleet.distributed_optimizer(
        nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))

    @fleet.distributed_step
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    index, count = fleet.worker_index(), fleet.worker_num()
    rows = GLOBAL_BATCH // count
    for step in range(steps):
        x, y = global_batch(step)
        mine = slice(index * rows, (index + 1) * rows)
        loss = train_step(model, optimizer, x[mine], y[mine])
        print(f"step:{step}\tloss:{float(loss):.6f}", flush=True)
    return params(model)


def train_reference(steps: int = STEPS) -> dict[str, np.ndarray]:
    """The single-card script: plain NNX + optax on one device."""
    import jax
    import optax
    from flax import nnx

    with jax.default_device(jax.devices("cpu")[0]):
        model = _model()
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
            optimizer.update(model, grads)
            return loss

        for step in range(steps):
            train_step(model, optimizer, *global_batch(step))
        return params(model)


def assert_same_params(path, reference: dict[str, np.ndarray]) -> None:
    """The parameters a job saved at ``path`` (.npz) equal ``reference`` within 1e-5."""
    got = dict(np.load(path))
    assert sorted(got) == sorted(reference)
    for key in reference:
        np.testing.assert_allclose(got[key], reference[key], atol=1e-5, rtol=0, err_msg=key)
