"""A PyTorch Lightning callback that logs gpumem's metrics beside the loss (``pip install jupyter-gpumem[lightning]``).

>>> trainer = lightning.Trainer(callbacks=[GpumemCallback(every_n_steps=50)])   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError:
        raise ImportError(
            "gpumem.integrations.lightning needs PyTorch Lightning: pip install jupyter-gpumem[lightning]"
        ) from None

from gpumem.core.monitoring.monitor import Monitor

__all__ = ["GpumemCallback"]


class GpumemCallback(Callback):  # type: ignore[misc]  # Lightning is not type-checked here
    """Every ``every_n_steps`` training batches, log ``gpumem/...`` metrics (peaks since the last log)
    through each of the trainer's loggers."""

    def __init__(self, every_n_steps: int = 50, monitor: Monitor | None = None, prefix: str = "gpumem") -> None:
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps is a whole number of steps (1 or more), not {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.monitor = monitor if monitor is not None else Monitor()
        self.prefix = prefix
        self.last_metrics: dict[str, float] = {}
        self.batches = 0

    def on_train_start(self, _trainer: Any, _pl_module: Any) -> None:
        self.monitor.start()
        self.monitor.metrics(self.prefix)  # the first interval starts here

    def on_train_batch_end(self, trainer: Any, *_batch_results: Any) -> None:
        self.batches += 1
        if self.batches % self.every_n_steps:
            return
        self.last_metrics = self.monitor.metrics(self.prefix)
        for logger in trainer.loggers:
            logger.log_metrics(self.last_metrics, step=trainer.global_step)

    def on_train_end(self, _trainer: Any, _pl_module: Any) -> None:
        self.monitor.stop()
