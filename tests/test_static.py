"""fleet.static.InputSpec, Paddle's ``paddle.static.InputSpec`` (issue 35): its
fields as Paddle keeps them, its errors, and what ``fleet.Model(inputs=...)``
says about a spec it cannot use. The model paths it feeds (summary, the
inference export) are in tests/test_hapi.py and tests/test_hapi_export.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fleet
from fleet.static import InputSpec


class Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def test_the_fields_are_paddles():
    spec = InputSpec(shape=[None, 784], dtype="float32", name="x")
    assert (spec.shape, spec.dtype, spec.name, spec.stop_gradient) == (
        (-1, 784), np.dtype("float32"), "x", False)  # Paddle keeps None as -1
    assert repr(spec) == "InputSpec(shape=(-1, 784), dtype=float32, name=x, stop_gradient=False)"
    assert spec == InputSpec((-1, 784), np.float32, "x") and spec != InputSpec((-1, 784))
    assert InputSpec([None, 2], jnp.bfloat16).dtype == jnp.bfloat16
    assert InputSpec(5).shape == (5,)
    assert spec.batch(8).shape == (8, -1, 784) and spec.unbatch().shape == (784,)
    got = InputSpec.from_numpy(np.zeros((2, 3), np.int32), name="ids")
    assert got == InputSpec((2, 3), "int32", "ids")
    assert InputSpec.from_tensor(jnp.zeros((4,), jnp.float16)) == InputSpec([4], "float16")
    assert len({spec, InputSpec((-1, 784), "float32", "x")}) == 1


@pytest.mark.parametrize("make, message", [
    (lambda: InputSpec("784"), r"InputSpec shape '784' is not a list of dimensions; give "
                               r"ints, with None \(or -1\)"),
    (lambda: InputSpec([None, 1.5]), r"shape \[None, 1\.5\] is not a list of dimensions"),
    (lambda: InputSpec([-2, 3]), r"shape \[-2, 3\] is not a list of dimensions"),
    (lambda: InputSpec([3], "floaty"), r"InputSpec dtype 'floaty' is not a dtype; give one "
                                       r"or its name, e.g. 'float32'"),
    (lambda: InputSpec.from_tensor([1, 2]), r"from_tensor takes an array .*got list"),
    (lambda: InputSpec([]).unbatch(), r"has no axis to remove"),
])
def test_a_bad_spec_says_what_to_give(make, message):
    with pytest.raises(fleet.FleetTypeError, match=message):
        make()


def test_a_spec_the_model_cannot_use_says_what_to_give(make_world, tmp_path):
    make_world(1)
    inner = fleet.Model(Net(nnx.Rngs(0)), inputs=[InputSpec([None, None])])
    with pytest.raises(fleet.FleetConfigError, match=r"entry 0 is InputSpec\(shape=\(-1, -1\).*"
                                                     r"only its first axis \(the batch\) may be "
                                                     r"unknown"):
        inner.save(tmp_path / "inner", training=False)
    odd = fleet.Model(Net(nnx.Rngs(0)), inputs=["x"])
    with pytest.raises(fleet.FleetConfigError, match=r"entry 0 is 'x'; give a "
                                                     r"fleet\.static\.InputSpec"):
        odd.summary()
    with pytest.raises(fleet.FleetConfigError, match=r"entry 0 is 'x'; give a "
                                                     r"fleet\.static\.InputSpec whose first axis"):
        odd.save(tmp_path / "odd", training=False)
    with pytest.raises(fleet.FleetTypeError, match=r"takes the number of inputs or a list of "
                                                   r"fleet\.static\.InputSpec"):
        fleet.Model(Net(nnx.Rngs(0)), inputs="x")


def test_a_spec_exports_for_any_batch(make_world, tmp_path):
    make_world(1)
    model = fleet.Model(Net(nnx.Rngs(0)), inputs=[InputSpec([None, 6], "float32", "x")])
    model.save(tmp_path / "infer", training=False)
    predict = fleet.load_inference(tmp_path / "infer")
    for rows in (1, 5):
        x = np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)
        np.testing.assert_allclose(np.asarray(predict(x)), np.asarray(model.network(x)),
                                   atol=1e-6)
    assert str(predict.exported.in_avals[-1].shape[0]) == "batch"
    assert model.summary()["total_params"] == 6 * 3 + 3  # a batch of one
