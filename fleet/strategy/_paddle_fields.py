"""Paddle 3.3's ``DistributedStrategy``, field by field: what each means in fleet.

Every public attribute of Paddle 3.3.1's ``DistributedStrategy`` (:data:`TOP`)
and every key of its ``*_configs`` dicts (:data:`KEYS`) is one of:

* ``run``: fleet does what Paddle does (its own implementation);
* ``mapped``: fleet does it with JAX's own means, under another name
  (``hybrid_configs.dp_degree`` is the replica count, ``enable_offload`` a host
  offload policy of ``jax.checkpoint``);
* ``no-op``: accepted, has no meaning in JAX (a static-graph pass, an NCCL or
  cuDNN knob, the parameter server); a value other than the one fleet does
  anyway (``same``) warns with a :class:`FleetWarning` that names the field and
  why (Python shows it once per line);
* ``refused``: accepting it would change the math in a way fleet cannot
  reproduce; a config value is refused where it is set, a section switch
  (``strategy.dgc = True``) by ``fleet.init``. Values in ``same`` are accepted.

Configuration: imports nothing of fleet but its errors. ``docs/strategy_fields.md``
is this table in words. (Over 350 lines on purpose: one table, a row a field, read
against Paddle's own list as a whole, and the few checks that read it; the
configuration is a fixed list of modules, tests/test_layers.py CONFIGURATION.)
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from fleet._errors import FleetConfigError, FleetTypeError, FleetUnsupportedError, FleetWarning

RUN, MAPPED, NOOP, REFUSED = "run", "mapped", "no-op", "refused"


@dataclasses.dataclass(frozen=True)
class Field:
    """One Paddle field: ``kind`` for a value outside ``same``, Paddle's default,
    and why."""

    kind: str
    default: Any
    reason: str
    same: tuple = ()

    @property
    def quiet(self) -> tuple:
        """The values that state what fleet does anyway (Paddle's default unless named)."""
        return self.same or (self.default,)


def _f(kind: str, default: Any, reason: str, *same: Any) -> Field:
    return Field(kind, tuple(default) if isinstance(default, list) else default, reason, same)


_PS = "parameter-server training; fleet trains collectively (all-reduce), so it has no effect"
_GRAPH = ("a static-graph (paddle.static) option; fleet's step is one XLA program, which XLA "
          "optimises and schedules itself")
_NCCL = "an NCCL communicator knob; XLA implements and schedules the collectives"
_CUDNN = "a cuDNN knob; XLA picks and autotunes the convolution algorithms itself"
_AUTO = ("Paddle's auto-parallel planner; fleet is data-parallel: the batch is split over the "
         "replicas and the model replicated")
_TRAINER = "Paddle's static-graph dataset trainer (dumps, sparse tables); fleet has no such trainer"
_MP = ("fleet is data-parallel only; for tensor parallelism shard the model with JAX's own "
       "sharding (jax.sharding, flax.nnx.with_partitioning)")
_PP = ("fleet is data-parallel only; for models that do not fit on one device use "
       "strategy.sharding with sharding_configs = {'stage': 3}, strategy.recompute and "
       "strategy.amp, or JAX's own sharding (jax.sharding)")
_SHARD = ("fleet runs ZeRO sharding as strategy.sharding = True with "
          "strategy.sharding_configs = {'stage': 1, 2 or 3, 'sharding_degree': N}")
_GROUP = "configures the groups of a parallelism whose degree must be 1 in fleet, so it has no effect"
_LOCALSGD = ("local SGD is not available; use strategy.gradient_merge (k_steps) to communicate once "
             "every k steps")


def _off(section: str) -> str:
    return f"a key of strategy.{section}, which fleet refuses, so it has no effect"


TOP: dict[str, Field] = {
    "fuse_all_reduce_ops": _f(RUN, True, "gradients travel in buckets, one psum per bucket"),
    "fuse_grad_size_in_MB": _f(RUN, 32, "the bucket size in MB"),
    "last_comm_group_size_MB": _f(RUN, 1.0, "the size cap of the bucket of the first layers"),
    "find_unused_parameters": _f(RUN, False, "both values run: in JAX a parameter that does not "
                                 "reach the loss gets a zero gradient, nothing waits for it"),
    "fp16_allreduce": _f(RUN, False, "gradient buckets travel as 16-bit floats"),
    "sync_batch_norm": _f(RUN, False, "BatchNorm over the global batch (True) or each replica's "
                          "rows (False); fleet's default None raises at a BatchNorm and asks"),
    "amp": _f(RUN, False, "mixed precision: layers compute in bfloat16 or float16"),
    "amp_configs": _f(RUN, None, "see its keys"),
    "recompute": _f(RUN, False, "named sub-modules run under nnx.remat"),
    "recompute_configs": _f(RUN, None, "see its keys"),
    "gradient_merge": _f(RUN, False, "one optimizer step every k_steps calls"),
    "gradient_merge_configs": _f(RUN, None, "see its keys"),
    "lars": _f(RUN, False, "a Momentum optimizer becomes optax.lars"),
    "lars_configs": _f(RUN, None, "see its keys"),
    "lamb": _f(RUN, False, "an Adam optimizer becomes optax.lamb"),
    "lamb_configs": _f(RUN, None, "see its keys"),
    "sharding": _f(RUN, False, "ZeRO stage 1, 2 or 3 over the replicas"),
    "sharding_configs": _f(RUN, None, "see its keys"),
    "hybrid_configs": _f(MAPPED, None, "only dp_degree may be above 1: plain data parallelism"),
    "gradient_scale_configs": _f(RUN, None, "see its keys"),
    "dgc": _f(REFUSED, False, "deep gradient compression is not available; use "
              "strategy.fp16_allreduce = True to halve the gradient traffic"),
    "dgc_configs": _f(NOOP, None, _off("dgc")),
    "localsgd": _f(REFUSED, False, _LOCALSGD),
    "localsgd_configs": _f(NOOP, None, _off("localsgd")),
    "adaptive_localsgd": _f(REFUSED, False, _LOCALSGD),
    "adaptive_localsgd_configs": _f(NOOP, None, _off("adaptive_localsgd")),
    "pipeline": _f(REFUSED, False, _PP),
    "pipeline_configs": _f(NOOP, None, _off("pipeline")),
    "tensor_parallel": _f(REFUSED, False, _MP),
    "tensor_parallel_configs": _f(NOOP, None, _off("tensor_parallel")),
    "asp": _f(REFUSED, False, "automatic 2:4 sparsity prunes the weights, which changes the model; "
              "fleet trains dense models"),
    "qat": _f(REFUSED, False, "quantization-aware training adds fake quantisation to the forward "
              "pass, which fleet does not do; quantise the model with a JAX library instead"),
    "qat_configs": _f(NOOP, None, _off("qat")),
    "a_sync": _f(NOOP, True, _PS + " (fleet's training is what a_sync = False asks for)", False),
    "a_sync_configs": _f(NOOP, None, _PS),
    "adam_d2sum": _f(NOOP, False, _PS),
    "fs_client_param": _f(NOOP, None, _PS),
    "sparse_table_configs": _f(NOOP, None, _PS),
    "fleet_desc_configs": _f(NOOP, None, _PS),
    "is_fl_ps_mode": _f(NOOP, False, _PS),
    "is_with_coordinator": _f(NOOP, False, _PS),
    "trainer_desc_configs": _f(NOOP, None, _TRAINER),
    "build_strategy": _f(NOOP, None, _GRAPH),
    "without_graph_optimization": _f(NOOP, True, _GRAPH),
    "fuse_grad_merge": _f(NOOP, False, _GRAPH),
    "fuse_grad_size_in_num": _f(NOOP, 8, "fleet's buckets are sized in MB (fuse_grad_size_in_MB)"),
    "sync_nccl_allreduce": _f(NOOP, True, _NCCL),
    "nccl_comm_num": _f(NOOP, 1, _NCCL),
    "use_hierarchical_allreduce": _f(NOOP, False, _NCCL),
    "hierarchical_allreduce_inter_nranks": _f(NOOP, 1, _NCCL),
    "heter_ccl_mode": _f(NOOP, False, _NCCL),
    "cudnn_exhaustive_search": _f(NOOP, False, _CUDNN),
    "conv_workspace_size_limit": _f(NOOP, 512, _CUDNN),
    "cudnn_batchnorm_spatial_persistent": _f(NOOP, False, _CUDNN),
    "auto": _f(NOOP, False, _AUTO),
    "semi_auto": _f(NOOP, False, _AUTO),
    "auto_search": _f(NOOP, False, _AUTO),
    "split_data": _f(NOOP, True, _AUTO),
    "elastic": _f(NOOP, False, "Paddle documents it as not valid; restarts belong to the launcher "
                  "(fleetrun)"),
}

_SCALING = "ignored under bfloat16, which needs no loss scaling"
_ASYNC = ("k_steps", -1), ("max_merge_var_num", 1), ("send_queue_size", 16), (
    "independent_recv_thread", False), ("min_send_grad_num_before_recv", 1), ("thread_pool_size", 1), (
    "send_wait_times", 1), ("runtime_split_send_recv", False), ("launch_barrier", True), (
    "heter_worker_device_guard", "cpu"), ("lr_decay_steps", 10), ("use_ps_gpu", 0), ("use_gpu_graph", 0)
_DUMP = ("dump_fields_path", ""), ("dump_fields", []), ("dump_param", []), ("stat_var_names", []), (
    "trainer", ""), ("device_worker", ""), ("local_sparse", []), ("remote_sparse", [])
_QAT = ("channel_wise_abs_max", True), ("weight_bits", 8), ("activation_bits", 8), (
    "not_quant_pattern", []), ("algo", "")
_GROUPS = ("mp_configs", "pp_configs", "sharding_configs", "dp_configs", "sep_configs",
           "dp_sep_configs", "pp_tp_configs", "ep_configs", "moe_sharding_configs",
           "default_comm_group_configs", "cp_configs", "cp_sharding_configs", "dp_cp_configs",
           "cp_mp_configs")
_DEGREES = {"mp_degree": _MP, "pp_degree": _PP, "sharding_degree": _SHARD, "sep_degree": _MP,
            "ep_degree": _MP, "moe_sharding_degree": _SHARD, "cp_degree": _MP,
            "cp_sharding_degree": _SHARD}

KEYS: dict[str, dict[str, Field]] = {
    "amp_configs": {
        "init_loss_scaling": _f(RUN, 32768.0, "float16's first loss scale; " + _SCALING),
        "incr_every_n_steps": _f(RUN, 1000, "finite steps before the scale grows; " + _SCALING),
        "decr_every_n_nan_or_inf": _f(RUN, 2, "overflowing steps before it shrinks; " + _SCALING),
        "incr_ratio": _f(RUN, 2.0, "the scale's growth factor; " + _SCALING),
        "decr_ratio": _f(RUN, 0.8, "the scale's shrink factor; " + _SCALING),
        "use_dynamic_loss_scaling": _f(RUN, True, "False keeps init_loss_scaling fixed"),
        "custom_white_list": _f(MAPPED, [], "module type names or paths that compute in the amp "
                                "dtype (Paddle: op names)"),
        "custom_black_list": _f(MAPPED, [], "module type names or paths that compute in float32 "
                                "(Paddle: op names)"),
        "custom_black_varnames": _f(NOOP, [], "names static-graph variables; list module paths "
                                    "in custom_black_list instead"),
        "use_pure_fp16": _f(RUN, False, "pure float16 (O2): normalisation layers too"),
        "use_fp16_guard": _f(NOOP, True, "a static-graph pure-float16 scope (paddle.static.amp."
                             "fp16_guard); fleet's pure mode casts every layer but the black list"),
        "use_optimizer_fp16": _f(NOOP, False, "fleet keeps parameters and optimizer state in "
                                 "float32 (master weights) under amp"),
        "use_pure_bf16": _f(RUN, False, "pure bfloat16 (O2)"),
    },
    "recompute_configs": {
        "checkpoints": _f(MAPPED, [], "dotted paths of the wrapped model's sub-modules (Paddle: "
                          "tensor or layer names)"),
        "enable_offload": _f(MAPPED, False, "the matmul outputs are saved in pinned host memory "
                             "(jax.checkpoint_policies.offload_dot_with_no_batch_dims) instead "
                             "of being recomputed; on CPU, whose host memory is the device's, "
                             "this changes nothing"),
        "checkpoint_shape": _f(NOOP, [], "the shape of Paddle's offload buffers; JAX knows the shapes"),
        "enable_tuning": _f(NOOP, False, _AUTO),
        "refined_ops_patterns": _f(NOOP, [], "Paddle's refined recompute of listed ops; choose "
                                   "what is kept with recompute_configs['policy']"),
    },
    "gradient_merge_configs": {
        "k_steps": _f(RUN, 1, "calls per optimizer step"),
        "avg": _f(RUN, True, "average (True) or sum the merged gradients"),
    },
    "lars_configs": {k: _f(RUN, d, "optax.lars's argument") for k, d in (
        ("lars_coeff", 0.001), ("lars_weight_decay", 0.0005), ("epsilon", 0.0),
        ("exclude_from_weight_decay", []))},
    "lamb_configs": {k: _f(RUN, d, "optax.lamb's argument") for k, d in (
        ("lamb_weight_decay", 0.01), ("exclude_from_weight_decay", []))},
    "sharding_configs": {
        "sharding_segment_strategy": _f(NOOP, "segment_broadcast_MB", "fleet segments the "
                                        "all-gather by size (segment_broadcast_MB)"),
        "segment_broadcast_MB": _f(RUN, 32.0, "the bucket size of the parameter all-gather"),
        "segment_anchors": _f(NOOP, [], "fleet segments the all-gather by size"),
        "sharding_degree": _f(RUN, 8, "replicas the state is split over; fleet's default 0 is all "
                              "of them (Paddle's 8 assumes 8 GPUs)"),
        "mp_degree": _f(REFUSED, 1, _MP),
        "dp_degree": _f(MAPPED, 1, "the groups the sharded state is replicated over: "
                        "dp_degree * sharding_degree must be the replica count"),
        "hybrid_dp": _f(RUN, False, "fleet replicates across groups whenever sharding_degree is "
                        "below the replica count"),
        "gradient_merge_acc_step": _f(REFUSED, 1, "it changes the update; use "
                                      "strategy.gradient_merge with gradient_merge_configs k_steps"),
        "optimize_offload": _f(NOOP, False, "fleet keeps the optimizer state on the device; the "
                               "update is the same"),
        "pp_allreduce_in_optimize": _f(NOOP, False, _off("pipeline")),
        "pp_degree": _f(REFUSED, 1, _PP),
        "optimize_cast": _f(NOOP, False, _GRAPH),
        "_dp_as_optimizer_sharding": _f(NOOP, False, _GRAPH),
        "stage": _f(RUN, 1, "ZeRO stage 1, 2 or 3"),
        "enable_tuning": _f(NOOP, False, _AUTO),
        "use_calc_stream": _f(NOOP, False, _NCCL),
    },
    "gradient_scale_configs": {
        "scale_strategy": _f(REFUSED, "avg", "fleet averages the gradients over the replicas "
                             "('avg'); to sum them or scale them yourself, scale the loss"),
        "scale_gradient": _f(NOOP, False, _off("pipeline") + " (Paddle's static sharding with "
                             "gradient merge)"),
    },
    "hybrid_configs": {
        "dp_degree": _f(MAPPED, -1, "the replica count: -1 (all) or equal to it, checked by fleet.init"),
        **{k: _f(REFUSED, 1, r) for k, r in _DEGREES.items()},
        **{k: _f(NOOP, {}, _GROUP) for k in _GROUPS},
        "enable_optimizer_timer": _f(NOOP, False, "Paddle's hybrid optimizer timer"),
        "split_norm_comm": _f(NOOP, False, _NCCL),
        "order": _f(RUN, ["dp", "pp", "sharding", "sep", "mp"], "with only dp_degree above 1 every "
                    "order is the same layout"),
    },
    "a_sync_configs": {k: _f(NOOP, d, _PS) for k, d in _ASYNC},
    "trainer_desc_configs": {k: _f(NOOP, d, _TRAINER) for k, d in _DUMP},
    "qat_configs": {k: _f(NOOP, d, _off("qat")) for k, d in _QAT},
    "dgc_configs": {k: _f(NOOP, d, _off("dgc")) for k, d in (
        ("rampup_begin_step", 0), ("rampup_step", 1), ("sparsity", []))},
    "localsgd_configs": {k: _f(NOOP, 1, _off("localsgd")) for k in ("k_steps", "begin_step")},
    "adaptive_localsgd_configs": {k: _f(NOOP, 1, _off("adaptive_localsgd"))
                                  for k in ("init_k_steps", "begin_step")},
    "pipeline_configs": {k: _f(NOOP, d, _off("pipeline")) for k, d in (
        ("micro_batch_size", 1), ("accumulate_steps", 1), ("schedule_mode", "1F1B"),
        ("p2p_cache_shape", True), ("enable_partial_send_recv", True))},
    "tensor_parallel_configs": {k: _f(NOOP, d, _off("tensor_parallel")) for k, d in (
        ("tensor_parallel_degree", 1), ("tensor_init_seed", -1))},
}


def check_type(owner: str, name: str, value: Any, expected: Any) -> Any:
    """Returns ``value`` converted to ``expected`` where that loses nothing, else raises
    (``None``: any value; ``tuple``: a list or tuple)."""
    if expected is None:
        return value
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected == bool | None:
        ok = value is None or isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif expected is tuple:
        ok = isinstance(value, (tuple, list))
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, expected)
    if not ok:
        raise FleetTypeError(
            f"{owner}.{name} must be of type {getattr(expected, '__name__', expected)}, got "
            f"{value!r} of type {type(value).__name__}")
    return value


def _type_of(default: Any) -> Any:
    return None if default is None else float if isinstance(default, float) else type(default)


def review(owner: str, name: str, value: Any, field: Field | None, stacklevel: int) -> None:
    """Warns about a no-op value, refuses a refused config value (a section switch
    waits for :func:`check_switches`); ``run`` and ``mapped`` values pass."""
    if field is None or field.kind in (RUN, MAPPED) or value in field.quiet:
        return
    given = f"strategy.{name} = {value!r}" if owner == "" else f"strategy.{owner}['{name}'] = {value!r}"
    if field.kind == NOOP:
        warnings.warn(f"{given} has no effect in fleet: {field.reason}. Leave it at "
                      f"{field.quiet[0]!r} (or remove it) to silence this warning",
                      FleetWarning, stacklevel=stacklevel)
    elif owner:
        allowed = " or ".join(repr(v) for v in field.quiet)
        raise FleetUnsupportedError(f"{given} is not supported: {field.reason}. Allowed: {allowed}")


def paddle_value(name: str, value: Any, stacklevel: int = 4) -> Any:
    """Checks a Paddle-only top-level field as it is set: its type, then
    :func:`review` (a ``*_configs`` dict key by key, onto Paddle's defaults)."""
    field = TOP[name]
    if name not in KEYS:
        value = check_type("DistributedStrategy", name, value, _type_of(field.default))
        review("", name, value, field, stacklevel)
        return value
    if not isinstance(value, dict):
        raise FleetTypeError(f"DistributedStrategy.{name} must be a dict, got {type(value).__name__}")
    unknown = sorted(set(value) - set(KEYS[name]))
    if unknown:
        raise FleetConfigError(f"DistributedStrategy.{name} has no key {unknown[0]!r}; its keys "
                               f"are: {', '.join(KEYS[name])}")
    config = paddle_default(name)
    for key, item in value.items():
        item = check_type(name, key, item, _type_of(KEYS[name][key].default))
        review(name, key, item, KEYS[name][key], stacklevel)
        config[key] = item
    if name == "hybrid_configs" and config["dp_degree"] != -1 and config["dp_degree"] < 1:
        raise FleetConfigError(f"hybrid_configs dp_degree must be -1 (all replicas) or at least 1, "
                               f"got {config['dp_degree']}")
    return config


def paddle_default(name: str) -> Any:
    """Paddle's default of a Paddle-only top-level field (a ``*_configs``: a dict)."""
    if name in KEYS:
        return {k: f.default for k, f in KEYS[name].items()}
    return TOP[name].default


def check_switches(values: dict[str, Any]) -> None:
    """Refuses a section switch fleet does not run (``fleet.init`` calls it)."""
    for name, value in values.items():
        if TOP[name].kind == REFUSED and value not in TOP[name].quiet:
            raise FleetUnsupportedError(
                f"strategy.{name} = {value!r} is not supported: {TOP[name].reason}. "
                f"Set strategy.{name} = False (its configs may stay)")


def check_degrees(strategy: Any, num_replicas: int) -> None:
    """Checks the degrees a strategy names against the world's replica count
    (``fleet.init``, once the devices are known): ``hybrid_configs`` dp_degree,
    and with ``strategy.sharding`` its sharding_degree and dp_degree."""
    dp = strategy.hybrid_configs["dp_degree"]
    if dp not in (-1, num_replicas):
        raise FleetConfigError(
            f"strategy.hybrid_configs dp_degree={dp}, but fleet.init found {num_replicas} "
            f"replicas; set dp_degree to {num_replicas} or -1 (all replicas), or pass "
            f"fleet.init(devices=...) with {dp} devices")
    if strategy.sharding:
        config = strategy.sharding_configs
        degree = config.degree(num_replicas)
        if config.dp_degree > 1 and config.dp_degree * degree != num_replicas:
            raise FleetConfigError(
                f"strategy.sharding_configs dp_degree={config.dp_degree} times sharding_degree="
                f"{degree} is not the {num_replicas} replicas; set dp_degree to "
                f"{num_replicas // degree} or 1")
