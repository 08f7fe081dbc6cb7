"""A Hugging Face ``TrainerCallback`` that adds gpumem's metrics to the Trainer's logs
(``pip install jupyter-gpumem[huggingface]``): TensorBoard, W&B or whatever the Trainer reports to gets them.

>>> trainer = Trainer(...)                     # doctest: +SKIP
>>> gpumem.integrations.huggingface.attach(trainer)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError:
    raise ImportError(
        "gpumem.integrations.huggingface needs transformers: pip install jupyter-gpumem[huggingface]"
    ) from None

from gpumem.core.monitoring.monitor import Monitor

__all__ = ["GpumemTrainerCallback", "attach"]


class GpumemTrainerCallback(TrainerCallback):  # type: ignore[misc]  # transformers' classes are untyped for mypy
    """Each time the Trainer logs (``logging_steps``), add ``gpumem/...`` metrics: peaks since the last log.

    The Trainer calls its reporters (TensorBoard, W&B...) before the callbacks given to it, so use
    :func:`attach` to put this one first; given in ``callbacks=[...]`` it adds to ``trainer.state.log_history``
    and to what later callbacks see.
    """

    def __init__(self, monitor: Monitor | None = None, prefix: str = "gpumem") -> None:
        self.monitor = monitor if monitor is not None else Monitor()
        self.prefix = prefix
        self.last_metrics: dict[str, float] = {}

    def on_train_begin(self, _args: Any, _state: Any, _control: Any, **_kwargs: Any) -> None:
        self.monitor.start()
        self.monitor.metrics(self.prefix)

    def on_log(self, _args: Any, state: Any, _control: Any, logs: dict[str, Any] | None = None, **_kwargs: Any) -> None:
        """The Trainer passes its logs dict before handing it to the reporters: adding to it logs ours too."""
        self.last_metrics = self.monitor.metrics(self.prefix)
        if logs is not None:
            logs.update(self.last_metrics)
        if state.log_history:
            state.log_history[-1].update(self.last_metrics)

    def on_train_end(self, _args: Any, _state: Any, _control: Any, **_kwargs: Any) -> None:
        self.monitor.stop()


def attach(trainer: Any, monitor: Monitor | None = None, prefix: str = "gpumem") -> GpumemTrainerCallback:
    """Add the callback ahead of the Trainer's reporters, so that they log gpumem's metrics too."""
    callback = GpumemTrainerCallback(monitor, prefix)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
