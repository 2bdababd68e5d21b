"""``fleet.callbacks``: hooks into :class:`fleet.Model`'s loops (Paddle's
``paddle.callbacks``).

Subclass :class:`Callback` for your own; ``fit`` adds a :class:`ProgBarLogger`
(``verbose > 0``) and a :class:`ModelCheckpoint` (``save_dir``) by itself.
"""

from fleet.hapi._callbacks import Callback, EarlyStopping, LRScheduler, ModelCheckpoint
from fleet.hapi._progbar import ProgBarLogger, ProgressBar

__all__ = [
    "Callback",
    "EarlyStopping",
    "LRScheduler",
    "ModelCheckpoint",
    "ProgBarLogger",
    "ProgressBar",
]
