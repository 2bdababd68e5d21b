"""``fleet.metric``: metrics for :class:`fleet.Model` (Paddle's ``paddle.metric``).

See ``fleet/hapi/_metric.py`` for how a metric is split between the device
(``compute``, per example) and the host (``update`` / ``accumulate``).
:func:`accuracy` is Paddle's function form: one batch's top-k accuracy.
"""

from fleet.hapi._metric import Accuracy, Metric, accuracy

__all__ = ["Accuracy", "Metric", "accuracy"]
