"""Issue 36 item 2: the distributed optimizer's features' state moved into its
``fleet_state`` (gradient merge's ``mini_step``, float16 amp's loss scale), and a
checkpoint written before, with the state at the optimizer's top
(``merge_count``, ``loss_scaling``...), restores into it bitwise, mid-run: the
run continued from it equals the run never stopped, bit for bit (its arrays at
the save set to the checkpoint's: the bits of float16 code vary between CPUs)
(tests/data/checkpoint/features_v1, written by tests/features_v1.py at commit
8bfd251). A ``fleet.Model`` ``.pdopt`` of the earlier names loads alike."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import fleet
from fleet.checkpoint import _migrate
from fleet.hapi import _saving
from fleet.runtime._leaves import module_variables, state_dict
from fleet.sections._amp import ScaleRules, ScaleState
from fleet.wrappers._fleet_state import FleetState
from fleet.wrappers._gradient_merge import MergeState, MergeSteps
from tests import features_v1, models
from tests.test_strategy import paddle_scale_rules

DATA = Path(__file__).parent / "data" / "checkpoint" / "features_v1"


def bits(*objs) -> list[tuple]:
    """Every array of ``objs`` (model and optimizer, ``grad_accum`` included) as
    (shape, dtype, bytes): equal lists are the same state bit for bit."""
    return [(a.shape, a.dtype, a.tobytes())
            for a in map(np.asarray, jax.tree.leaves(nnx.state(objs)))]


def features(opt) -> dict:
    return {k: np.asarray(v).item() for k, v in state_dict(opt).items()
            if k.startswith("fleet_state.")}


#: The earlier fleet's names of the features' state, today's beside them (the
#: other variables kept their names)
EARLIER_NAMES = {"merge_count": "fleet_state.merge.mini_step",
                 "loss_scaling": "fleet_state.amp.loss_scaling",
                 "good_steps": "fleet_state.amp.good_steps",
                 "bad_steps": "fleet_state.amp.bad_steps",
                 "skipped_steps": "fleet_state.amp.skipped_steps"}


def stored(name: str) -> dict[str, np.ndarray]:
    """The checkpoint's arrays as orbax reads them, fleet aside, by today's names."""
    directory = DATA.resolve() / name / str(features_v1.RUNS[name][3])
    arrays = {}
    for part in ("model", "optimizer"):
        reader = ocp.PyTreeCheckpointer()
        tree = reader.metadata(directory / part)
        tree = getattr(getattr(tree, "item_metadata", tree), "tree", tree)
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        arrays.update(reader.restore(directory / part,
                                     args=ocp.args.PyTreeRestore(restore_args=as_numpy)))
    return {EARLIER_NAMES.get(k, k): v for k, v in arrays.items()}


def set_arrays(arrays: dict, *objs) -> None:
    """Each variable of ``objs`` set to ``arrays``' array of its name, placed as it was."""
    for obj in objs:
        for k, var in module_variables(obj).items():
            var.set_value(jax.device_put(arrays[k], var.get_value().sharding))


@pytest.mark.parametrize("name", sorted(features_v1.RUNS))
def test_an_earlier_checkpoint_restores_bitwise_mid_run(make_world, tmp_path, name):
    """Each array comes back as stored, bit for bit, and the run continued from the
    restore equals the run never stopped. (That run is this machine's, with its
    arrays at the save set to the checkpoint's: XLA:CPU's float16 code differs
    between CPUs, so a run of its own may differ from the stored one in the last bits.)"""
    _, _, total, saved, _ = features_v1.RUNS[name]
    checkpoint = stored(name)
    model, opt, step = features_v1.build(name)
    errors = features_v1.calls(name, model, opt, step, 0, saved)
    features_at_save = features(opt)
    set_arrays(checkpoint, model, opt)
    assert features(opt) == features_at_save  # (the run's own count and scale)
    assert features_v1.calls(name, model, opt, step, saved, total) == []
    straight = bits(model, opt)

    model, opt, step = features_v1.build(name)
    shutil.copytree(DATA / name, tmp_path / name)
    with fleet.CheckpointManager(tmp_path / name, async_save=False) as manager:
        assert manager.restore_latest(model=model, optimizer=opt).step == saved
    restored = {**state_dict(model), **state_dict(opt)}
    assert restored.keys() == checkpoint.keys()
    for k, array in checkpoint.items():
        assert (restored[k].dtype, restored[k].tobytes()) == (array.dtype, array.tobytes()), k
    assert features(opt) == features_at_save
    assert features_v1.calls(name, model, opt, step, saved, total) == []
    assert bits(model, opt) == straight

    if name == "merge":  # saved on call k-1 of the second cycle
        assert features_at_save == {"fleet_state.merge.mini_step": 3}
        assert int(opt.merge_count[...]) == 0 and int(opt.step[...]) == 2
    elif name == "amp":  # 1024 -> 2048 -> 1024, one non-finite step in a row when saved
        assert features_at_save == {"fleet_state.amp.loss_scaling": 1024.0,
                                    "fleet_state.amp.good_steps": 0,
                                    "fleet_state.amp.bad_steps": 1,
                                    "fleet_state.amp.skipped_steps": 3}
    else:  # check_nan_inf keeps no state in the optimizer: the skipped call left it as it was
        assert features_at_save == {} and int(opt.step[...]) == total - 1
        assert len(errors) == 1 and errors[0].startswith("2: check_nan_inf: gradient")


def test_a_checkpoint_names_the_features_state_under_fleet_state(make_world, tmp_path):
    model, opt, step = features_v1.build("amp")
    with fleet.CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        manager.save(0, model=model, optimizer=opt)
    with fleet.CheckpointManager(tmp_path / "ckpt", async_save=False) as manager:
        manager.restore(0, model=model, optimizer=opt)
    keys = sorted(k for k in state_dict(opt) if not k.startswith("opt_state."))
    assert keys == ["fleet_state.amp.bad_steps", "fleet_state.amp.good_steps",
                    "fleet_state.amp.loss_scaling", "fleet_state.amp.skipped_steps", "step"]
    assert set(_migrate.RENAMED.values()) >= set(keys) - {"step"}


def test_an_earlier_pdopt_loads_under_todays_names(make_world):
    """``Model.save``'s ``.pdopt`` of an earlier fleet (built by hand: today's
    state under the earlier names) loads; one that fits no name is refused."""
    model, opt, step = features_v1.build("amp")
    features_v1.calls("amp", model, opt, step, 0, 4)
    today = state_dict(opt)
    earlier = {old if new in today else new: v for old, new in _migrate.RENAMED.items()
               for v in [today.get(new)] if v is not None}
    earlier.update({k: v for k, v in today.items() if not k.startswith("fleet_state.")})
    assert "loss_scaling" in earlier and not any(k.startswith("fleet_state") for k in earlier)

    model, fresh, _ = features_v1.build("amp")
    _saving.set_optimizer_state_dict(fresh, earlier)
    got = state_dict(fresh)
    assert got.keys() == today.keys()
    for k in today:
        assert np.asarray(got[k]).tobytes() == np.asarray(today[k]).tobytes(), k
    with pytest.raises(fleet.FleetError, match="does not fit this optimizer"):
        _saving.set_optimizer_state_dict(fresh, {**earlier, "loss_scale": earlier["loss_scaling"]})


def test_the_features_are_optax_style_init_update_pairs(make_world):
    """Gradient merge and float16 amp as ``optax.MultiSteps`` / ``apply_if_finite``
    are: ``init()`` a NamedTuple state, ``update`` a pure function of it (jitted
    here), the scale moving by Paddle's rules; with neither on, the optimizer
    holds what ``nnx.Optimizer`` holds."""
    merge = MergeSteps(k_steps=4, avg=True)
    state, counts = merge.init(), []
    for _ in range(6):
        state = jax.jit(merge.update)(state)
        counts.append(int(state.mini_step))
    assert isinstance(state, MergeState) and counts == [1, 2, 3, 0, 1, 2]

    rules = ScaleRules(init_loss_scaling=1024.0, use_dynamic_loss_scaling=True,
                       incr_every_n_steps=2, decr_every_n_nan_or_inf=2, incr_ratio=2.0,
                       decr_ratio=0.5)
    finite = [True, True, False, False, True, False, True, True, True, False, True]
    state, scales = rules.init(), []
    for ok in finite:
        state = jax.jit(rules.update)(state, jnp.asarray(ok))
        scales.append(float(state.loss_scaling))
    assert isinstance(state, ScaleState)
    assert scales == paddle_scale_rules(finite, 1024.0, 2, 2, 2.0, 0.5)
    assert int(state.skipped_steps) == finite.count(False)

    make_world(2)
    model = fleet.distributed_model(models.LinearNet(nnx.Rngs(0)))
    plain = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    opt = fleet.distributed_optimizer(nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param))
    assert opt.fleet_state == FleetState(merge=None, amp=None)
    assert state_dict(opt).keys() == state_dict(plain).keys()
    with pytest.raises(AttributeError, match="keeps no loss scale"):
        opt.loss_scaling  # noqa: B018
