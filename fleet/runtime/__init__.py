"""The runtime: what every layer above stands on.

The process's environment and launcher contract (``_env``, a cluster's launcher
included; ``_worker``, ``_coordinator``: the knock at the coordinator before joining,
``_heartbeat``), the XLA:CPU flags set before JAX starts
(``_xla_flags``), the bounded agreement between processes (``_agree``), the world
``fleet.init`` builds (``_world``: mesh, strategy, replica count), and a pytree's
leaves by name (``_leaves``) and placed replicated on the mesh (``_replicate``).
Imports nothing of fleet above the configuration (``fleet.strategy``).
"""
