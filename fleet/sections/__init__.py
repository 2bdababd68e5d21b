"""The strategy sections' implementations (their configuration: ``fleet.strategy``).

``amp`` (``_amp``), ``sync_batch_norm`` (``_batch_norm``), ``lars`` / ``lamb``
(``_large_batch``, ``_hparams``), ``recompute`` (``_recompute``), ``sharding`` stages 1-2
(``_sharding``, ``_shard_probe``, ``_slices``) and ``check_nan_inf``
(``_finite``, ``_finite_replay``). Builds on ``fleet.comm`` and ``fleet.runtime``.
"""
