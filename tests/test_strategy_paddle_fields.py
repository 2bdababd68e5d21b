"""Every field and config key of Paddle 3.3's ``DistributedStrategy`` (issue 23).

The names below are Paddle 3.3.1's, listed from ``paddle.distributed.fleet``
(its public properties, and the keys of each ``*_configs`` dict, plus the
``order`` key its ``hybrid_configs`` setter takes). Each is set to a value other
than the one fleet does anyway: it runs (read back, ``check`` passes, no
warning), is mapped (the same), warns as a no-op naming the field and the reason
of ``fleet/strategy/_paddle_fields.py``, or is refused with that reason. Nothing
is silent, and ``docs/strategy_fields.md`` has a row for each.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import jax
import pytest
from flax import nnx

import fleet
from fleet.strategy import _paddle_fields as pf
from tests import models
from tests.jaxpr_utils import equations
from tests.test_strategy import MLP6, grads_step

PADDLE_FIELDS = [
    "build_strategy", "gradient_scale_configs", "a_sync", "a_sync_configs", "trainer_desc_configs",
    "adam_d2sum", "fs_client_param", "sparse_table_configs", "fleet_desc_configs", "amp",
    "amp_configs", "asp", "qat", "qat_configs", "recompute", "sync_nccl_allreduce",
    "use_hierarchical_allreduce", "hierarchical_allreduce_inter_nranks", "sync_batch_norm",
    "fuse_all_reduce_ops", "fuse_grad_size_in_MB", "last_comm_group_size_MB",
    "find_unused_parameters", "nccl_comm_num", "recompute_configs", "sharding", "sharding_configs",
    "without_graph_optimization", "fuse_grad_merge", "fuse_grad_size_in_num", "pipeline",
    "is_fl_ps_mode", "is_with_coordinator", "pipeline_configs", "tensor_parallel",
    "tensor_parallel_configs", "hybrid_configs", "localsgd", "localsgd_configs",
    "adaptive_localsgd", "adaptive_localsgd_configs", "dgc", "dgc_configs", "fp16_allreduce",
    "gradient_merge", "gradient_merge_configs", "lars", "lars_configs", "lamb", "lamb_configs",
    "elastic", "auto", "semi_auto", "auto_search", "split_data", "heter_ccl_mode",
    "cudnn_exhaustive_search", "conv_workspace_size_limit", "cudnn_batchnorm_spatial_persistent",
]

PADDLE_KEYS = {
    "gradient_scale_configs": ["scale_strategy", "scale_gradient"],
    "a_sync_configs": [
        "k_steps", "max_merge_var_num", "send_queue_size", "independent_recv_thread",
        "min_send_grad_num_before_recv", "thread_pool_size", "send_wait_times",
        "runtime_split_send_recv", "launch_barrier", "heter_worker_device_guard", "lr_decay_steps",
        "use_ps_gpu", "use_gpu_graph"],
    "trainer_desc_configs": ["dump_fields_path", "dump_fields", "dump_param", "stat_var_names",
                             "trainer", "device_worker", "local_sparse", "remote_sparse"],
    "amp_configs": [
        "init_loss_scaling", "incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_ratio",
        "decr_ratio", "use_dynamic_loss_scaling", "custom_white_list", "custom_black_list",
        "custom_black_varnames", "use_pure_fp16", "use_fp16_guard", "use_optimizer_fp16",
        "use_pure_bf16"],
    "qat_configs": ["channel_wise_abs_max", "weight_bits", "activation_bits", "not_quant_pattern",
                    "algo"],
    "recompute_configs": ["checkpoints", "enable_offload", "checkpoint_shape", "enable_tuning",
                          "refined_ops_patterns"],
    "sharding_configs": [
        "sharding_segment_strategy", "segment_broadcast_MB", "segment_anchors", "sharding_degree",
        "mp_degree", "dp_degree", "hybrid_dp", "gradient_merge_acc_step", "optimize_offload",
        "pp_allreduce_in_optimize", "pp_degree", "optimize_cast", "_dp_as_optimizer_sharding",
        "stage", "enable_tuning", "use_calc_stream"],
    "pipeline_configs": ["micro_batch_size", "accumulate_steps", "schedule_mode", "p2p_cache_shape",
                         "enable_partial_send_recv"],
    "tensor_parallel_configs": ["tensor_parallel_degree", "tensor_init_seed"],
    "hybrid_configs": [
        "dp_degree", "mp_degree", "pp_degree", "sharding_degree", "sep_degree", "mp_configs",
        "pp_configs", "sharding_configs", "enable_optimizer_timer", "split_norm_comm", "ep_degree",
        "moe_sharding_degree", "dp_configs", "sep_configs", "dp_sep_configs", "pp_tp_configs",
        "ep_configs", "moe_sharding_configs", "default_comm_group_configs", "cp_degree",
        "cp_sharding_degree", "cp_configs", "cp_sharding_configs", "dp_cp_configs", "cp_mp_configs",
        "order"],
    "localsgd_configs": ["k_steps", "begin_step"],
    "adaptive_localsgd_configs": ["init_k_steps", "begin_step"],
    "dgc_configs": ["rampup_begin_step", "rampup_step", "sparsity"],
    "gradient_merge_configs": ["k_steps", "avg"],
    "lars_configs": ["lars_coeff", "lars_weight_decay", "epsilon", "exclude_from_weight_decay"],
    "lamb_configs": ["lamb_weight_decay", "exclude_from_weight_decay"],
}

#: Values to set where the generic one (below) is not a valid one that differs.
PROBES = {
    "fuse_grad_size_in_MB": 16, "last_comm_group_size_MB": 2.0, "sync_batch_norm": True,
    "amp_configs.decr_ratio": 0.5, "amp_configs.incr_ratio": 3.0,
    "amp_configs.custom_white_list": ["Linear"], "amp_configs.custom_black_list": ["Linear"],
    "sharding_configs.stage": 2, "sharding_configs.sharding_degree": 2,
    "sharding_configs.segment_broadcast_MB": 16.0, "sharding_configs.sharding_segment_strategy":
    "segment_anchors", "gradient_scale_configs.scale_strategy": "sum",
    "hybrid_configs.dp_degree": 4, "hybrid_configs.order": ["mp", "dp", "pp", "sharding", "sep"],
}
#: What a section's keys need beside them for ``check`` to pass.
BASE = {"recompute_configs": {"checkpoints": ["layers.0"]}}
BEFORE = {"recompute": {"recompute_configs": {"checkpoints": ["layers.0"]}}}


def probe(name, field):
    if name in PROBES:
        return PROBES[name]
    d = field.default
    if isinstance(d, bool):
        return not field.quiet[0]
    if isinstance(d, (int, float)):
        return d + 1 if d > 0 else 2
    if isinstance(d, str):
        return d + "_other"
    if isinstance(d, tuple):
        return ["some_name"]
    if isinstance(d, dict):
        return {"nccl_config": {}}
    return object()  # an opaque Paddle object (build_strategy, fs_client_param...)


def read(strategy, config, key):
    value = getattr(strategy, config)
    return value[key] if isinstance(value, dict) else getattr(value, key)


def same(a, b):
    return list(a) == list(b) if isinstance(a, (list, tuple)) else a == b


CASES = [(name, None) for name in PADDLE_FIELDS if name not in PADDLE_KEYS] + [
    (config, key) for config, keys in PADDLE_KEYS.items() for key in keys]


def test_the_table_lists_every_paddle_field_and_key_and_nothing_else():
    assert sorted(pf.TOP) == sorted(PADDLE_FIELDS)
    assert {c: sorted(k) for c, k in pf.KEYS.items()} == {c: sorted(k) for c, k in PADDLE_KEYS.items()}
    assert set(PADDLE_KEYS) <= set(PADDLE_FIELDS)
    assert len(PADDLE_FIELDS) == 59 and sum(map(len, PADDLE_KEYS.values())) == 110
    assert all(f.kind in (pf.RUN, pf.MAPPED, pf.NOOP, pf.REFUSED) and f.reason
               for f in [*pf.TOP.values(), *(f for k in pf.KEYS.values() for f in k.values())])


@pytest.mark.parametrize("config, key", CASES, ids=[f"{c}.{k}" if k else c for c, k in CASES])
def test_each_field_runs_is_mapped_warns_or_is_refused(config, key):
    field = pf.KEYS[config][key] if key else pf.TOP[config]
    name = f"{config}.{key}" if key else config
    value = probe(name, field)
    assert value not in field.quiet
    strategy = fleet.DistributedStrategy()
    section = config[: -len("_configs")] if key else None

    def set_it():
        if key:
            setattr(strategy, config, {**BASE.get(config, {}), key: value})
            if section in ("amp", "recompute", "sharding", "gradient_merge", "lars", "lamb"):
                setattr(strategy, section, True)  # its configs are used
        else:
            for other, given in BEFORE.get(config, {}).items():
                setattr(strategy, other, given)
            setattr(strategy, config, value)
        strategy.check()

    reason = re.escape(field.reason)
    shown = re.escape(f"strategy.{config}['{key}']" if key else f"strategy.{config}")
    if field.kind == pf.NOOP:
        with pytest.warns(fleet.FleetWarning, match=f"{shown} = .* has no effect in fleet: {reason}"):
            set_it()
    elif field.kind == pf.REFUSED:
        with pytest.raises(fleet.FleetUnsupportedError, match=f"{shown} = .* is not supported: {reason}"):
            set_it()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            set_it()
        got = read(strategy, config, key) if key else getattr(strategy, config)
        assert value is None or same(got, value)


@pytest.mark.parametrize("config, key", [c for c in CASES if c[1] is None or
                                         pf.KEYS[c[0]][c[1]].kind in (pf.NOOP, pf.REFUSED)])
def test_the_value_fleet_does_anyway_is_quiet(config, key):
    field = pf.KEYS[config][key] if key else pf.TOP[config]
    strategy = fleet.DistributedStrategy()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if key:
            setattr(strategy, config, {key: field.quiet[0]})
        elif config not in pf.KEYS and field.default is not None:
            setattr(strategy, config, field.quiet[0])
        strategy.check()


def test_defaults_are_paddles():
    """Each field and key fleet keeps reads as Paddle 3.3.1's default, but the two
    documented ones: sync_batch_norm (None: a BatchNorm step asks) and
    sharding_degree (0: all replicas; Paddle's 8 assumes 8 GPUs)."""
    strategy = fleet.DistributedStrategy()
    differ = {("sync_batch_norm", None): (None, False), ("sharding_configs", "sharding_degree"): (0, 8)}
    for config, key in CASES:
        field = pf.KEYS[config][key] if key else pf.TOP[config]
        if field.default is None:
            continue
        got = read(strategy, config, key) if key else getattr(strategy, config)
        if (config, key) in differ:
            assert (got, field.default) == differ[(config, key)]
        else:
            assert same(got, field.default), (config, key, got)
    assert fleet.DistributedStrategy().amp_configs.decr_ratio == 0.8


def test_a_no_op_warns_once_per_line():
    strategy = fleet.DistributedStrategy()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            strategy.nccl_comm_num = 2
    assert len(seen) == 1 and "nccl_comm_num" in str(seen[0].message)
    assert strategy.nccl_comm_num == 2


def test_a_paddle_config_is_checked_key_by_key():
    strategy = fleet.DistributedStrategy()
    with pytest.raises(fleet.FleetConfigError, match="hybrid_configs has no key 'dp_degre'"):
        strategy.hybrid_configs = {"dp_degre": 2}
    with pytest.raises(fleet.FleetTypeError, match="hybrid_configs.dp_degree must be of type int"):
        strategy.hybrid_configs = {"dp_degree": "2"}
    with pytest.raises(fleet.FleetConfigError, match="dp_degree must be -1 .* or at least 1, got 0"):
        strategy.hybrid_configs = {"dp_degree": 0}
    with pytest.raises(fleet.FleetTypeError, match="a_sync must be of type bool"):
        strategy.a_sync = 1
    strategy.hybrid_configs = {"dp_degree": 4, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
    assert strategy.hybrid_configs["dp_degree"] == 4 and strategy.hybrid_configs["sep_degree"] == 1


class Degrees:
    """What check_degrees reads of a strategy."""

    def __init__(self, dp=-1, sharding=False, **sharding_configs):
        s = fleet.DistributedStrategy()
        s.hybrid_configs = {"dp_degree": dp}
        s.sharding, s.sharding_configs = sharding, sharding_configs
        self.strategy = s


@pytest.mark.parametrize("dp, sharding, configs, replicas, match", [
    (-1, False, {}, 8, None),
    (8, False, {}, 8, None),
    (4, False, {}, 8, r"dp_degree=4, but fleet.init found 8 replicas; set dp_degree to 8 or -1"),
    (-1, True, {"sharding_degree": 2, "dp_degree": 4}, 8, None),
    (-1, True, {"sharding_degree": 2, "dp_degree": 2}, 8, r"dp_degree=2 times sharding_degree=2 "
                                                          r"is not the 8 replicas; set dp_degree to 4"),
    (-1, True, {"sharding_degree": 3}, 8, r"sharding_degree=3 does not divide the 8 replicas"),
])
def test_check_degrees_against_the_replicas(dp, sharding, configs, replicas, match):
    strategy = Degrees(dp, sharding, **configs).strategy
    if match is None:
        pf.check_degrees(strategy, replicas)
    else:
        with pytest.raises(fleet.FleetConfigError, match=match):
            pf.check_degrees(strategy, replicas)


def to_host(jaxpr) -> int:
    """The values the traced step moves to host memory (``device_put`` to it)."""
    return sum(e.primitive.name == "device_put" and jax.memory.Space.Host in e.params["devices"]
               for e in equations(jaxpr))


def test_enable_offload_keeps_the_gradients_and_moves_to_host(make_world):
    """recompute_configs enable_offload: the traced step moves the saved matmul
    outputs to pinned host memory (XLA:GPU/TPU keep them there; XLA:CPU, whose
    host memory is its device memory, drops the moves); the gradients are those
    without recompute."""
    x, y = models.batches("linear", 1, 64)[0]
    results = {}
    for offload in (None, False, True):
        s = fleet.DistributedStrategy()
        if offload is not None:
            s.recompute = True
            s.recompute_configs = {"checkpoints": ["layers.0", "layers.1"], "enable_offload": offload}
        make_world(2, s)
        model = fleet.distributed_model(MLP6(nnx.Rngs(0), width=32))
        step = fleet.distributed_step(grads_step)
        moved = to_host(step.make_jaxpr(model, x, y))
        results[offload] = (models.flat_params(nnx.to_pure_dict(step(model, x, y))), moved)
    assert models.max_diff(results[True][0], results[None][0]) <= 1e-6
    assert results[True][1] > 0 and results[False][1] == results[None][1] == 0
    with pytest.raises(fleet.FleetConfigError, match="enable_offload=True .* choose one"):
        fleet.DistributedStrategy().recompute_configs = {"enable_offload": True,
                                                         "policy": "dots_saveable"}


def test_the_doc_has_a_row_for_each():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "strategy_fields.md").read_text()
    for config, key in CASES:
        field = pf.KEYS[config][key] if key else pf.TOP[config]
        row = f"| `{key or config}` | {field.kind} |"
        assert row in doc, row
