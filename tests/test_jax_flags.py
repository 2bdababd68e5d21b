"""jax's upgrade flags of jax 0.10 to 0.12 (issue 35): ``jax_custom_vjp3`` and
``jax_remat3``, off by default, switched on by users ahead of jax's change.

Under ``jax_custom_vjp3`` a differentiated trace keeps no custom-VJP call, so the
guard against a loss summed over the rows cannot see fleet's gradient sync: it
refuses instead of passing such a loss unseen. A mean loss, the buckets and
recompute train as on one device with both flags on (tests/test_buckets.py,
tests/test_no_sync.py and the recompute tests pass under JAX_CUSTOM_VJP3=1
JAX_REMAT3=1)."""

import jax
import pytest

import fleet
from tests import models
from tests.test_outputs import _assert_close, _nnx_run, _summed_nnx


@pytest.fixture
def flags(request):
    for name in request.param:
        jax.config.update(name, True)
    yield
    for name in request.param:
        jax.config.update(name, False)


@pytest.mark.parametrize("flags", [("jax_custom_vjp3",)], indirect=True)
def test_a_summed_loss_under_custom_vjp3_is_refused(make_world, flags):
    with pytest.raises(fleet.FleetUnsupportedError, match=(
            r"sums a value over the batch rows, and fleet cannot check it with jax's "
            r"custom_vjp3 upgrade flag on \(JAX_CUSTOM_VJP3=1\).*turn the flag off")):
        _nnx_run(4, _summed_nnx, make_world)


@pytest.mark.parametrize("flags", [("jax_custom_vjp3", "jax_remat3")], indirect=True)
def test_a_mean_loss_under_both_flags_matches_one_device(make_world, flags):
    got, ref, d_params = _nnx_run(4, models.nnx_train_step, make_world)
    _assert_close("custom_vjp3 + remat3, 4 replicas", got, ref, d_params)
    assert jax.config.jax_custom_vjp3 and jax.config.jax_remat3
