"""``Model.fit`` / ``evaluate`` / ``predict``'s callbacks, assembled (Paddle's
``config_callbacks``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fleet._errors import FleetConfigError, FleetTypeError
from fleet.hapi._callbacks import Callback, CallbackList, ModelCheckpoint
from fleet.hapi._progbar import ProgBarLogger


def config_callbacks(model: Any, callbacks: Sequence[Callback] | None, params: dict[str, Any],
                     train_loader: Any = None, resume: bool = False,
                     ) -> tuple[CallbackList, ModelCheckpoint | None]:
    """The callbacks of a run: the user's, a progress logger unless ``params["verbose"]``
    is 0 or one is given, and a :class:`ModelCheckpoint` for ``params["save_dir"]``
    unless one is given; each gets the model and ``params``.
    Returns them, and the checkpoint callback that saves (``None`` if none does),
    which gets the training loader (whose position it saves); ``fit(resume=True)``
    needs one."""
    cbks = list(callbacks or [])
    for cb in cbks:
        if not isinstance(cb, Callback):
            raise FleetTypeError(
                f"callbacks must be fleet.callbacks.Callback objects, got "
                f"{type(cb).__name__}; subclass fleet.callbacks.Callback"
            )
    if params["verbose"] and not any(isinstance(cb, ProgBarLogger) for cb in cbks):
        cbks.insert(0, ProgBarLogger(params["log_freq"], params["verbose"]))
    if (params.get("save_dir") is not None
            and not any(isinstance(cb, ModelCheckpoint) for cb in cbks)):
        cbks.append(ModelCheckpoint(params["save_freq"], params["save_dir"]))
    for cb in cbks:
        cb.set_model(model)
        cb.set_params(params)
    checkpoints = [cb for cb in cbks if isinstance(cb, ModelCheckpoint) and cb.save_dir]
    for cb in checkpoints:
        cb.loader = train_loader
    if resume and not checkpoints:
        raise FleetConfigError(
            "fit(resume=True) continues from the checkpoints in save_dir, but no "
            "save_dir was given; pass save_dir=... (the same as the run to resume)"
        )
    return CallbackList(cbks), checkpoints[0] if checkpoints else None
