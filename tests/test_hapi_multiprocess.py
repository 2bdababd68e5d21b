"""fleet.Model under fleetrun, 2 processes x 2 CPU devices, with no code change.

The worker script is a single-device fleet.Model script (no fleet.init). It must
train the single-device script's parameters (within 1e-5), evaluate exactly,
predict in dataset order, and print progress only on the first worker.
"""

import json
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.fleetrun_jobs import Jobs
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

ROOT = Path(__file__).resolve().parents[1]
PROCESSES, LOCAL = 2, 2

WORKER = textwrap.dedent(f"""
    import json, sys
    sys.path.insert(0, {str(ROOT)!r})
    from fleet.hapi import Model, metric            # the only fleet import of the script
    import numpy as np, optax
    from flax import nnx
    from fleet.io import TensorDataset
    from tests.test_hapi import Net, ce, flat_params, make_data

    train, test = make_data({N_TRAIN}, seed=0), make_data({N_EVAL}, seed=1)
    model = Model(Net(nnx.Rngs(0)))
    model.prepare(optax.adam(1e-2), ce, metric.Accuracy())
    history = model.fit(TensorDataset(list(train)), TensorDataset(list(test)),
                        batch_size={GLOBAL_BATCH // (PROCESSES * LOCAL)}, epochs=2,
                        log_freq=2, verbose=2)
    result = model.evaluate(TensorDataset(list(test)), batch_size=3, verbose=0)
    pred = model.predict(TensorDataset([test[0]]), batch_size=3, stack_outputs=True,
                         verbose=0)[0]
    import fleet, jax
    model.save("ckpt")
    if fleet.is_first_worker():
        np.savez("params.npz", pred=pred, **flat_params(model.network))
        json.dump({{"history": history, "result": result, "replicas": fleet.num_replicas(),
                   "processes": jax.process_count()}}, open("result.json", "w"))
""")


@pytest.fixture
def job(tmp_path):
    jobs = Jobs(tmp_path)
    yield lambda: jobs.run(WORKER, PROCESSES, LOCAL, "hapi-test")
    jobs.close()


def test_fit_under_fleetrun_trains_the_single_device_model(job, tmp_path):
    output, logs = job()
    info = json.loads((tmp_path / "result.json").read_text())
    assert info["processes"] == PROCESSES and info["replicas"] == PROCESSES * LOCAL
    saved = dict(np.load(tmp_path / "params.npz"))
    pred = saved.pop("pred")
    train, test = make_data(N_TRAIN, 0), make_data(N_EVAL, 1)
    assert max_diff(saved, reference_params(*train, GLOBAL_BATCH, epochs=2)) < TOL

    logits = single_device_logits(saved, test[0])
    assert info["result"]["acc"] == (logits.argmax(1) == test[1]).sum() / N_EVAL
    assert info["result"]["loss"] == pytest.approx(float(ce(logits, test[1]).mean()), abs=1e-6)
    assert info["history"][-1]["eval_acc"] == info["result"]["acc"]
    np.testing.assert_allclose(pred, logits, atol=TOL, rtol=0)
    assert sorted(p.name for p in tmp_path.glob("ckpt*")) == ["ckpt.pdopt", "ckpt.pdparams"]

    # Progress on the first worker only: 100 samples / 16 per step = 7 steps per epoch.
    assert re.search(r"^step 2/7 - loss: \d\.\d{4} - acc: \d\.\d{4} - \d+ samples/s$",
                     output, re.M)  # rank 0's lines, unprefixed
    assert "Eval samples: 37" in logs[0]
    assert "step" not in logs[1] and "Epoch" not in logs[1]
