"""``fleet.metric``: metrics for :class:`fleet.Model` (Paddle's ``paddle.metric``).

See ``fleet/hapi/_metric.py`` for how a metric is split between the device
(``compute``, per example) and the host (``update`` / ``accumulate``).
"""

from fleet.hapi._metric import Accuracy, Metric

__all__ = ["Accuracy", "Metric"]
