"""Two real processes x two CPU devices, through the real launcher (gloo on
127.0.0.1), train what one process trains: one fleetrun job runs every scenario
(``tests/workers/two_processes.py``), and each test here checks one scenario's
results against its single-process reference.

The job starts once per session, when the first of these tests runs.
"""

import json
import re

import numpy as np
import pytest

import fleet
from fleet.io import DistributedBatchSampler
from tests import jobs, models
from tests.test_contract_multiprocess import mnist_split_reference
from tests.test_hapi import (
    GLOBAL_BATCH,
    N_EVAL,
    N_TRAIN,
    TOL,
    ce,
    make_data,
    max_diff,
    reference_params,
    single_device_logits,
)
from tests.workers import contract_train, sharding_train, strategy_train
from tests.workers import two_processes as worker


class Scenarios:
    """The job's results: ``dir(name)`` is a scenario's directory, ``output(name)``
    its lines on the console (rank 0's), ``log(name, rank)`` its lines in a log."""

    def __init__(self, job: jobs.Job, out):
        self.job, self.out = job, out

    def dir(self, name):
        return self.out / name

    @staticmethod
    def _section(text, name):
        return text.split(f"=== {name}\n", 1)[1].split(f"=== {name} done\n", 1)[0]

    def output(self, name):
        return self._section(self.job.output, name)

    def log(self, name, rank):
        return self._section(self.job.log(rank), name)


@pytest.fixture(scope="session")
def scenarios(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-processes")
    job = jobs.two_processes(tmp, worker.__file__, str(tmp / "out"), timeout=200)
    print(f"one fleetrun job, {len(worker.SCENARIOS)} scenarios: {job.seconds:.1f} s")
    return Scenarios(job, tmp / "out")


def test_core_two_processes_match_single_card(scenarios):
    """LinearNet with Adam; also all_reduce / broadcast / all_gather / barrier."""
    ref_losses, ref_params = models.nnx_reference("linear", models.batches("linear", 10, 16))
    result = np.load(scenarios.dir("core") / "result.npz")
    assert np.abs(result["losses"] - np.array(ref_losses)).max() < 1e-5
    assert models.max_diff({k: result[k] for k in ref_params}, ref_params) < 1e-5


def test_step_shapes_across_two_processes(scenarios):
    """(a), (b) and (e) on 2 processes x 2 devices equal the single-device steps."""
    got = dict(np.load(scenarios.dir("shapes") / "result.npz"))
    expected = {}
    data = models.batches("linear", contract_train.STEPS, contract_train.BATCH)
    expected.update({"a" + k: v for k, v in models.nnx_reference("linear", data)[1].items()})
    expected.update({"b" + k: v for k, v in models.linen_reference("linear", data)[1].items()})
    expected.update(mnist_split_reference(models.batches("cnn", 3, contract_train.BATCH)))
    for prefix in ("a", "b", "egrad", "e"):
        part = {k: v for k, v in got.items() if k.startswith(prefix) and
                not (prefix == "e" and k.startswith("egrad"))}
        ref = {k: v for k, v in expected.items() if k in part}
        d = models.max_diff(part, ref)
        print(f"({prefix}) 2 processes x 2 devices: |fleet - single device| = {d:.2e}")
        assert d < 1e-5, prefix


def test_the_composed_strategy_across_two_processes_equals_one_process(scenarios, make_world):
    """amp, recompute, gradient_merge, LAMB and fp16_allreduce, with a no_sync call
    (issue 12, acceptance 7), against the same strategy in one process on 4 devices."""
    got = dict(np.load(scenarios.dir("strategy") / "result.npz"))
    make_world(4, strategy_train.strategy())
    expected = strategy_train.train()
    assert got.keys() == expected.keys()
    assert int(got["optimizer_steps"]) == int(expected["optimizer_steps"]) == 3
    params = {k: v for k, v in got.items() if k.startswith("p")}
    d_params = models.max_diff(params, {k: expected[k] for k in params})
    state = {k: v for k, v in got.items() if k.startswith("o")}
    d_state = models.max_diff(state, {k: expected[k] for k in state})
    d_loss = float(np.abs(got["losses"] - expected["losses"]).max())
    print(f"composed strategy, 2 processes x 2 devices vs 1 process x 4 devices: "
          f"|params| = {d_params:.2e}, |optimizer state| = {d_state:.2e}, |losses| = {d_loss:.2e}")
    assert d_params < 1e-6 and d_state < 1e-6 and d_loss < 1e-6


def test_sharding_two_processes_equal_one_process_and_their_checkpoint_restores_there(
        scenarios, make_world):
    """Stage 1 (NNX), stage 2 (Linen TrainState) and stage 3 (NNX) against the same
    runs in one process on 4 devices; the checkpoint the two processes wrote restores in one
    process, bitwise."""
    import optax
    from flax import nnx

    from tests.test_sharding import logical_opt_state

    got = dict(np.load(scenarios.dir("sharding") / "result.npz"))
    make_world(4, sharding_train.strategy(1))
    expected = sharding_train.train(init=lambda s: make_world(4, s))
    assert got.keys() == expected.keys()
    diffs = {}
    for prefix, what in (("p", "NNX params"), ("o", "NNX optimizer state"),
                         ("l", "Linen params"), ("s", "NNX stage-3 params")):
        keys = [k for k in got if k.startswith(prefix)]
        diffs[what] = models.max_diff({k: got[k] for k in keys}, {k: expected[k] for k in keys})
    diffs["losses"] = float(np.abs(got["losses"] - expected["losses"]).max())
    print("sharding, 2 processes x 2 devices vs 1 process x 4 devices: " + ", ".join(
        f"|{k}| = {v:.2e}" for k, v in diffs.items()))
    assert all(v < 1e-6 for v in diffs.values())

    make_world(4, sharding_train.strategy(2))
    model = fleet.distributed_model(models.CNN(nnx.Rngs(1)))
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    with fleet.checkpoint.CheckpointManager(scenarios.dir("sharding") / "ckpt") as manager:
        manager.restore(sharding_train.STEPS, model=model, optimizer=opt)
    state = logical_opt_state(opt)
    assert all(np.array_equal(state[k], got["o" + k]) for k in state)
    assert models.max_diff(models.flat_params(model),
                           {k[1:]: v for k, v in got.items() if k.startswith("p")}) == 0


def test_fit_under_fleetrun_trains_the_single_device_model(scenarios):
    """A single-device fleet.Model script (no fleet.init) trains the single-device
    script's parameters, evaluates exactly, predicts in dataset order, and prints
    progress only on the first worker."""
    here = scenarios.dir("hapi")
    info = json.loads((here / "result.json").read_text())
    assert info["processes"] == worker.PROCESSES
    assert info["replicas"] == worker.PROCESSES * worker.LOCAL
    saved = dict(np.load(here / "params.npz"))
    pred = saved.pop("pred")
    train, test = make_data(N_TRAIN, 0), make_data(N_EVAL, 1)
    assert max_diff(saved, reference_params(*train, GLOBAL_BATCH, epochs=2)) < TOL

    logits = single_device_logits(saved, test[0])
    assert info["result"]["acc"] == (logits.argmax(1) == test[1]).sum() / N_EVAL
    assert info["result"]["loss"] == [pytest.approx(float(ce(logits, test[1]).mean()), abs=1e-6)]
    assert info["history"][-1]["eval_acc"] == info["result"]["acc"]
    np.testing.assert_allclose(pred, logits, atol=TOL, rtol=0)
    assert sorted(p.name for p in here.glob("ckpt*")) == ["ckpt.pdopt", "ckpt.pdparams"]

    # Progress on the first worker only: 100 samples / 16 per step = 7 steps per epoch.
    assert re.search(r"^step 2/7 - loss: \d\.\d{4} - acc: \d\.\d{4} - \d+(s|ms|us)/step$",
                     scenarios.output("hapi"), re.M)  # rank 0's lines, unprefixed
    assert "Eval samples: 37" in scenarios.log("hapi", 0)
    assert "step" not in scenarios.log("hapi", 1) and "Epoch" not in scenarios.log("hapi", 1)


def test_each_device_of_each_process_gets_its_replica_batch(scenarios):
    """Each process loads its share through the DataLoader: every device's rows
    equal the single-replica samplers', and exact evaluation sees each sample once,
    on every process."""
    n, batch = worker.IO_N, worker.IO_BATCH
    results = [json.loads((scenarios.dir("io") / f"result.{rank}.json").read_text())
               for rank in range(worker.PROCESSES)]
    replicas = worker.PROCESSES * worker.LOCAL
    mesh_ids = results[0]["mesh_ids"]
    assert all(r["mesh_ids"] == mesh_ids for r in results)
    samplers = [DistributedBatchSampler(range(n), batch, num_replicas=replicas, rank=r,
                                        shuffle=True) for r in range(replicas)]
    want = [step for _ in range(2) for step in zip(*[list(s) for s in samplers])]
    for process, result in enumerate(results):
        assert len(result["steps"]) == len(want)
        for got, per_replica in zip(result["steps"], want):
            assert got["shape"] == [sum(len(b) for b in per_replica)]
            assert got["x_ok"]
            mine = range(process * worker.LOCAL, (process + 1) * worker.LOCAL)
            assert got["shards"] == {str(mesh_ids[r]): per_replica[r] for r in mine}
        # Exact evaluation across processes: every sample once per epoch, on every process.
        seen = np.array(result["seen"]).reshape(2, n)
        assert [sorted(epoch) for epoch in seen.tolist()] == [list(range(n))] * 2


def test_processes_a_worker_starts_stay_out_of_the_job(scenarios):
    """Loader workers (num_workers=2) give the batches of num_workers=0 and the job
    lives on; a multiprocessing child and a subprocess child import fleet without
    joining, and their fleet.init says why it will not join (issue 19)."""
    here = scenarios.dir("children")
    for rank in range(worker.PROCESSES):
        loader = json.loads((here / f"loader.{rank}.json").read_text())
        assert loader["batches"]["2"] == loader["batches"]["0"] and loader["batches"]["0"]
        assert loader["exitcode"] == 0
        for kind in ("multiprocessing", "subprocess"):
            seen = json.loads((here / f"{kind}.{rank}.json").read_text())
            assert seen["parent"] == loader["pid"], kind
            assert not seen["joined_at_import"] and not seen["joined"], kind
            assert seen["init"].startswith(
                f"this process (pid {seen['pid']}) was started by process {rank} of the job "
                f"(pid {loader['pid']}); only the processes the launcher started join"), seen


def test_check_nan_inf_raises_on_every_process_at_the_same_call(scenarios):
    """A non-finite row on one process only: both processes raise at call 3,
    naming call 2, and hold the state of the single-device step after call 1."""
    first = models.batches("linear", 3, 16)[:1]  # (the worker's first of 3 batches)
    ref_losses, ref_params = models.nnx_reference("linear", first)
    params = []
    for rank in (0, 1):
        message = json.loads((scenarios.dir("finite") / f"message.{rank}.json").read_text())
        assert message is not None and "after call 2 of the step" in message, (rank, message)
        assert "call 3, started since, ran and left it unchanged too" in message, message
        result = dict(np.load(scenarios.dir("finite") / f"result.{rank}.npz"))
        assert abs(result["losses"][0] - ref_losses[0]) < 1e-5
        assert models.max_diff({k: result[k] for k in ref_params}, ref_params) < 1e-5
        params.append(result)
    assert all(np.array_equal(params[0][k], params[1][k]) for k in ref_params)


def test_processes_that_all_pass_the_same_rows_are_refused_at_the_first_call(scenarios):
    """Both processes pass the whole batch (the four steps as written for one
    card): each raises at call 1, quickly, naming the fix; the refused call left
    the state alone, and call 2 with each process's own rows (the message's
    ``x[jax.process_index()::jax.process_count()]``) equals the single-device step
    on the global batch. After a constant warm-up batch (let through), the whole
    batch is refused at the next call."""
    ref_losses, ref_params = models.nnx_reference("linear", models.batches("linear", 1, 16))
    params = []
    for rank in range(worker.PROCESSES):
        out = json.loads((scenarios.dir("same_rows") / f"result.{rank}.json").read_text())
        whole = out["whole"]
        assert whole.get("error") == "FleetError", (rank, whole)
        for part in ("every process passed the same batch rows", "call 1,",
                     "16 rows, identical on all 2 processes",
                     "x[jax.process_index()::jax.process_count()]",
                     "DistributedBatchSampler", "global jax.Array"):
            assert part in whole["message"], (rank, part, whole["message"])
        assert whole["seconds"] < 20, whole  # no wait for a timeout
        assert abs(out["own"]["loss"] - ref_losses[0]) < 1e-5, out["own"]
        got = dict(np.load(scenarios.dir("same_rows") / f"result.{rank}.npz"))
        d = models.max_diff(got, ref_params)
        print(f"same_rows, rank {rank}: own rows after the refused call, "
              f"|params - single device| = {d:.2e}, |loss| = "
              f"{abs(out['own']['loss'] - ref_losses[0]):.2e}")
        assert d < 1e-5
        params.append(got)
        assert "loss" in out["warmup"], out["warmup"]
        after = out["after_warmup"]
        assert after.get("error") == "FleetError", (rank, after)
        assert "every process passed the same batch rows" in after["message"]
        assert "call 2," in after["message"], after["message"]
    assert all(np.array_equal(params[0][k], params[1][k]) for k in params[0])


def test_dropout_across_two_processes_equals_one_device(scenarios):
    """2 processes x 2 devices draw what 1 process x 4 devices draws: each replica
    its rows of the single-device mask (tests/test_random.py's NNX script)."""
    import optax
    from flax import nnx

    from tests.test_random import DropNet, data, leaves, nnx_run, nnx_step

    model = DropNet(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_losses = nnx_run(nnx.jit(nnx_step), model, optimizer, data())
    ref = leaves(nnx.state((model, optimizer)))
    got = [dict(np.load(scenarios.dir("random") / f"result.{rank}.npz")) for rank in (0, 1)]
    assert int(got[0]["replicas"]) == 4
    for result in got:
        np.testing.assert_allclose(result["losses"], ref_losses, rtol=2e-6, atol=2e-6)
        diff = max(float(np.max(np.abs(result[f"leaf{i}"].astype(np.float64) - x)))
                   for i, x in enumerate(ref))
        print(f"state max diff from one device: {diff:.2e}")
        assert diff < 1e-5
    assert all(np.array_equal(got[0][f"leaf{i}"], got[1][f"leaf{i}"]) for i in range(len(ref)))


def test_verify_across_two_processes(scenarios):
    """strategy.verify_steps=2 under fleetrun: each process checks the step against
    one device on the gathered global batch; process 0 prints one line per call;
    a max declared 'mean' raises on both processes at the first call, naming it."""
    lines = [ln for ln in scenarios.output("verify").splitlines() if "fleet verify" in ln]
    assert len(lines) == 3, lines
    assert all("matches one device" in ln for ln in lines[:2]) and "now off" in lines[2]
    for rank in (0, 1):
        with open(scenarios.dir("verify") / f"result.{rank}.json") as f:
            got = json.load(f)
        assert len(got["losses"]) == 3
        assert got["bad"].startswith("call 1: verify, call 1: output 1 differs"), got["bad"]


def test_metrics_across_two_processes_equal_one_device(scenarios):
    """2 processes x 2 devices update nnx.metrics as one device does: a mean loss
    averaged, a float sum summed over every process's replicas, a Welford fed the
    per-example errors gathered in global order (tests/test_metrics.py)."""
    import optax
    from flax import nnx

    from tests import models
    from tests.test_metrics import process_metrics, process_metrics_step

    model = models.LinearNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    metrics = process_metrics()
    step = nnx.jit(process_metrics_step)
    for x, y in models.batches("linear", 3, 16):
        step(model, optimizer, metrics, x, y)
    want = {"/".join(map(str, p)): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(metrics))}
    for rank in (0, 1):
        got = dict(np.load(scenarios.dir("metrics") / f"result.{rank}.npz"))
        assert set(got) == set(want)
        print(rank, {k: float(v) for k, v in got.items()})
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)
