"""``heartbeat()``, the worker side of the liveness signal, lives in the core
(``fleet/_worker.py``); it is re-exported here as ``fleet.launch.heartbeat``."""

from fleet._worker import heartbeat

__all__ = ["heartbeat"]
