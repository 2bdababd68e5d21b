"""The whole strategy through the real launcher (issue 12, acceptance 7): amp,
recompute, gradient_merge, LAMB and fp16_allreduce, with a no_sync call, on 2
processes x 2 CPU devices equal the same strategy in one process with the same
global batch on 4 devices."""

import numpy as np

from tests import models
from tests.test_contract_multiprocess import fleetrun
from tests.workers import strategy_train as worker


def test_the_composed_strategy_across_two_processes_equals_one_process(tmp_path, make_world):
    out = tmp_path / "result.npz"
    code, log, _ = fleetrun(tmp_path, str(out), worker="strategy_train.py")
    assert code == 0, log[-4000:]
    got = dict(np.load(out))

    make_world(4, worker.strategy())
    expected = worker.train()
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
