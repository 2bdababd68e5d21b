"""The one fleetrun job of the default test tier: every "2 processes equal one
process" scenario, one after the other, in one launch of 2 processes x 2 CPU
devices (``tests/test_two_processes.py`` starts it and checks each scenario).

    fleetrun --nproc_per_node 2 --cpu_devices 2 tests/workers/two_processes.py OUT

Each scenario runs in its own directory ``OUT/NAME`` and writes its results
there; its console lines sit between ``=== NAME`` and ``=== NAME done``.

* ``hapi``: a single-device ``fleet.Model`` script (no ``fleet.init``: it runs
  first, so it joins by itself, as a seed-003 script does);
* ``io``: ``fleet.io.DataLoader`` batches and exact evaluation on every process;
* ``children``: processes a worker starts stay out of the job: a DataLoader's
  worker processes (their batches equal ``num_workers=0``'s), a multiprocessing
  child and a subprocess child that import fleet and call ``fleet.init``;
* ``core``: LinearNet with Adam, models broadcast from process 0, and the
  collectives (``all_reduce``, ``broadcast``, ``all_gather``, ``barrier``);
* ``shapes``: the core contract's step shapes (a), (b) and (e);
* ``strategy``: amp, recompute, gradient_merge, LAMB, fp16_allreduce and no_sync;
* ``sharding``: ZeRO stage 1 (NNX, with a checkpoint), stage 2 (Linen) and stage 3 (NNX);
* ``finite``: ``check_nan_inf``, a non-finite row on process 1 only;
* ``same_rows``: both processes pass the whole batch (the four steps as written
  for one card): refused on every process at the first call; then each passes
  its own rows. A constant warm-up batch is let through, the whole batch after
  it is not;
* ``random``: NNX dropout (``tests/test_random.py``): each replica draws its rows
  of the single-device mask, whatever process it is on;
* ``metrics``: ``nnx.metrics`` updated in the step (``tests/test_metrics.py``):
  a mean, a float sum and a per-example Welford end as on one device;
* ``verify``: ``strategy.verify_steps=2`` (``tests/test_verify.py``): a step that
  equals one device passes on both processes (process 0 prints its lines); a max
  declared ``'mean'`` raises on both at the same call.
"""

import json
import multiprocessing
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import fleet  # noqa: E402
from tests.workers import (  # noqa: E402
    child_probe,
    contract_train,
    core_train,
    sharding_train,
    strategy_train,
)

SCENARIOS = ("hapi", "io", "children", "core", "shapes", "strategy", "sharding", "finite",
             "same_rows", "random", "metrics", "verify")
PROCESSES, LOCAL = 2, 2
HAPI_BATCH = 16 // (PROCESSES * LOCAL)  # tests/test_hapi.py's GLOBAL_BATCH per replica
IO_N, IO_BATCH = 37, 2


def hapi() -> None:
    import jax
    import optax
    from flax import nnx

    from fleet.hapi import Model, metric
    from fleet.io import TensorDataset
    from tests.test_hapi import N_EVAL, N_TRAIN, Net, ce, flat_params, make_data

    train, test = make_data(N_TRAIN, seed=0), make_data(N_EVAL, seed=1)
    model = Model(Net(nnx.Rngs(0)))
    model.prepare(optax.adam(1e-2), ce, metric.Accuracy())
    history = model.fit(TensorDataset(list(train)), TensorDataset(list(test)),
                        batch_size=HAPI_BATCH, epochs=2, log_freq=2, verbose=2)
    result = model.evaluate(TensorDataset(list(test)), batch_size=3, verbose=0)
    pred = model.predict(TensorDataset([test[0]]), batch_size=3, stack_outputs=True,
                         verbose=0)[0]
    model.save("ckpt")
    if fleet.is_first_worker():
        np.savez("params.npz", pred=pred, **flat_params(model.network))
        with open("result.json", "w") as f:
            json.dump({"history": history, "result": result, "replicas": fleet.num_replicas(),
                       "processes": jax.process_count()}, f)


def io() -> None:
    from fleet.io import DataLoader, TensorDataset

    world = fleet.init(is_collective=True)
    x = np.arange(IO_N * 2, dtype=np.float32).reshape(IO_N, 2)
    loader = DataLoader(TensorDataset([x, np.arange(IO_N)]), batch_size=IO_BATCH, shuffle=True)
    out = {"mesh_ids": [d.id for d in world.mesh.devices.flat], "steps": [], "seen": []}
    for epoch in range(2):
        for xb, yb in loader:
            assert xb.sharding == world.batch and yb.sharding == world.batch
            assert xb.shape == (yb.shape[0], 2)
            out["steps"].append({
                "epoch": epoch,
                "shape": list(yb.shape),
                "shards": {str(s.device.id): np.asarray(s.data).tolist()
                           for s in yb.addressable_shards},
                "x_ok": all(np.array_equal(np.asarray(s.data), x[np.asarray(t.data)])
                            for s, t in zip(xb.addressable_shards, yb.addressable_shards)),
            })
            out["seen"] += loader.gather_for_metrics(yb).tolist()
    with open(f"result.{fleet.worker_index()}.json", "w") as f:
        json.dump(out, f)


def children() -> None:
    from fleet.io import DataLoader, TensorDataset

    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    x = np.arange(IO_N * 2, dtype=np.float32).reshape(IO_N, 2)
    batches = {}
    for workers in (0, 2):  # loader workers import fleet: they must not join the job
        loader = DataLoader(TensorDataset([x]), batch_size=IO_BATCH, shuffle=True,
                            num_workers=workers)
        batches[workers] = [[np.asarray(s.data).tolist() for s in xb.addressable_shards]
                            for (xb,) in loader]
    child = multiprocessing.get_context("spawn").Process(
        target=child_probe.main, args=(f"multiprocessing.{rank}.json",))
    child.start()
    child.join(timeout=120)
    subprocess.run([sys.executable, child_probe.__file__, f"subprocess.{rank}.json"],
                   check=True, timeout=120)
    with open(f"loader.{rank}.json", "w") as f:
        json.dump({"batches": batches, "pid": os.getpid(), "exitcode": child.exitcode}, f)


def core() -> None:
    core_train.main("result.npz")


def shapes() -> None:
    contract_train.main("result.npz", "shapes")


def strategy() -> None:
    strategy_train.main("result.npz")


def sharding() -> None:
    sharding_train.main("result.npz", os.path.abspath("ckpt"))


def finite() -> None:
    """``check_nan_inf``: call 2's only non-finite row is on process 1. Every
    process raises at call 3 (each reads call 2's chain once call 3 has started),
    and keeps the state call 1 left."""
    import optax
    from flax import nnx

    from tests import models

    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy(check_nan_inf=True))
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = fleet.distributed_optimizer(
        nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param))
    step = fleet.distributed_step(models.nnx_train_step)
    rank = fleet.worker_index()
    rows = np.array_split(np.arange(16), fleet.worker_num())[rank]
    (x1, y1), (x2, y2), (x3, y3) = models.batches("linear", 3, 16)
    losses = [float(step(model, optimizer, x1[rows], y1[rows]))]
    x2 = x2[rows].copy()
    if rank == 1:
        x2[0, 0] = np.nan
    step(model, optimizer, x2, y2[rows])
    message = None
    try:
        step(model, optimizer, x3[rows], y3[rows])
    except fleet.FleetError as e:
        message = str(e)
    np.savez(f"result.{rank}.npz", losses=np.array(losses), **models.flat_params(model))
    with open(f"message.{rank}.json", "w") as f:
        json.dump(message, f)


def same_rows() -> None:
    """Call 1 passes the whole global batch on both processes: every process
    raises (before anything runs), and call 2, with each process's own rows (the
    fix the message names), trains what one device trains on the global batch. A
    second step's warm-up call passes zeros on both processes (let through: a
    constant batch), and its next call the whole batch (refused, at call 2)."""
    import time

    import jax
    import optax
    from flax import nnx

    from tests import models

    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    (x, y), = models.batches("linear", 1, 16)

    def attempt(step, *args):
        start = time.monotonic()
        try:
            return {"loss": float(step(*args))}
        except fleet.FleetError as e:
            return {"error": type(e).__name__, "message": str(e),
                    "seconds": time.monotonic() - start}

    def train():
        model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
        optimizer = fleet.distributed_optimizer(
            nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param))
        return fleet.distributed_step(models.nnx_train_step), model, optimizer

    step, model, optimizer = train()
    out = {"whole": attempt(step, model, optimizer, x, y)}
    mine = slice(jax.process_index(), None, jax.process_count())  # the message's fix
    out["own"] = attempt(step, model, optimizer, x[mine], y[mine])
    np.savez(f"result.{rank}.npz", **models.flat_params(model))

    step, model, optimizer = train()
    zeros = (np.zeros_like(x), np.zeros_like(y))
    out["warmup"] = attempt(step, model, optimizer, *zeros)
    out["after_warmup"] = attempt(step, model, optimizer, x, y)
    with open(f"result.{rank}.json", "w") as f:
        json.dump(out, f)


def random() -> None:
    """tests/test_random.py's NNX dropout script, each process passing its rows."""
    import jax
    import optax
    from flax import nnx

    from tests.test_random import DropNet, data, leaves, nnx_step

    fleet.init(is_collective=True)
    model = fleet.distributed_model(DropNet(nnx.Rngs(0, dropout=1)))
    optimizer = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    step = fleet.distributed_step(nnx_step)
    rank = fleet.worker_index()
    losses = []
    for x, y in data():
        rows = np.array_split(np.arange(len(x)), fleet.worker_num())[rank]
        losses.append(float(step(model, optimizer, x[rows], y[rows])))
    state = leaves(nnx.state((model, optimizer)))
    assert fleet.check_replicas(nnx.state((model, optimizer))) == []
    np.savez(f"result.{rank}.npz", losses=np.array(losses), replicas=jax.device_count(),
             **{f"leaf{i}": x for i, x in enumerate(state)})


def metrics() -> None:
    """Each process passes its rows; the metrics' state is saved per process."""
    import optax
    from flax import nnx

    from tests import models
    from tests.test_metrics import process_metrics, process_metrics_step

    fleet.init(is_collective=True)
    rank = fleet.worker_index()
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    metrics = process_metrics()
    step = fleet.distributed_step(process_metrics_step)
    for x, y in models.batches("linear", 3, 16):
        rows = np.array_split(np.arange(len(x)), fleet.worker_num())[rank]
        step(model, optimizer, metrics, x[rows], y[rows])
    np.savez(f"result.{rank}.npz", **{"/".join(map(str, p)): np.asarray(v.get_value())
                                      for p, v in nnx.to_flat_state(nnx.state(metrics))})


def verify() -> None:
    """Each process passes its rows; the reference runs on each process's first
    device, on the gathered global batch."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from tests import models

    fleet.init(is_collective=True, strategy=fleet.DistributedStrategy(verify_steps=2))
    rank = fleet.worker_index()
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.adam(models.LR), wrt=nnx.Param)

    def max_declared_mean(model, optimizer, x, y):
        return models.nnx_train_step(model, optimizer, x, y), jnp.max(jnp.abs(x))

    def rows(a):
        return np.array_split(a, fleet.worker_num())[rank]

    out = {}
    step = fleet.distributed_step(models.nnx_train_step)
    out["losses"] = [float(step(model, optimizer, rows(x), rows(y)))
                     for x, y in models.batches("linear", 3, 16)]
    bad = fleet.distributed_step(max_declared_mean, out_reduce=(None, "mean"))
    call = 0
    try:
        for x, y in models.batches("linear", 2, 16):
            call += 1
            bad(model, optimizer, rows(x), rows(y))
        out["bad"] = "no error"
    except fleet.FleetError as e:
        out["bad"] = f"call {call}: {e}"
    with open(f"result.{rank}.json", "w") as f:
        json.dump(out, f)


def main(out: str) -> None:
    for name in SCENARIOS:
        here = os.path.join(os.path.abspath(out), name)
        os.makedirs(here, exist_ok=True)
        os.chdir(here)
        print(f"=== {name}", flush=True)
        globals()[name]()
        fleet.barrier_worker()
        print(f"=== {name} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
