"""Gradient synchronisation: buckets, the reducer and the collectives.

The bucket plan and the one bucket loop (``_buckets``), the communication
hooks it calls and the strategy's choice of them (``_hooks``), the wrapped
model's gradient sync in the backward pass and the step's trace record
(``_sync``), the functional reducer (``_reduce``), ZeRO's reduce-scatter and
gather (``_shard_comm``), the public
collectives (``fleet.all_reduce`` and friends, ``_collective``) and the replica
check (``fleet.check_replicas``, ``_replicas``). Builds on ``fleet.runtime``.
"""
