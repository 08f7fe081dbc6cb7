"""The Lightning and Hugging Face callbacks, with the real frameworks when they are installed."""

from __future__ import annotations

from typing import Any

import pytest

from gpumem.core.monitoring.monitor import Monitor
from gpumem.testing import MIB, FakeSource


def test_lightning_callback_logs_gpumem_metrics_every_n_batches(tmp_path: Any) -> None:
    torch = pytest.importorskip("torch")
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import Logger

    from gpumem.integrations.lightning import GpumemCallback

    logged: list[tuple[int, dict[str, float]]] = []

    class ListLogger(Logger):  # type: ignore[misc]
        name = "list"
        version = "0"

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            if any(key.startswith("gpumem/") for key in metrics):
                logged.append((step or 0, metrics))

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    source = FakeSource()

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            source.transient((batch_idx + 1) * MIB)  # a known peak per batch
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(6, 4)), batch_size=1)
    callback = GpumemCallback(every_n_steps=2, monitor=Monitor(source, warn_at=None))
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", logger=ListLogger(), callbacks=[callback],
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    trainer.fit(Tiny(), data)
    assert [step for step, _ in logged] == [2, 4, 6]
    peaks = [metrics["gpumem/cuda0/peak_allocated_bytes"] for _, metrics in logged]
    assert peaks == [2 * MIB, 4 * MIB, 6 * MIB]  # the highest batch of each pair: peaks since the last log
    assert not callback.monitor.running


def test_huggingface_callback_adds_metrics_to_the_logs() -> None:
    transformers = pytest.importorskip("transformers")
    from gpumem.integrations.huggingface import GpumemTrainerCallback, attach

    source = FakeSource()
    callback = GpumemTrainerCallback(Monitor(source, warn_at=None))
    args, control = None, transformers.TrainerControl()
    state = transformers.TrainerState()
    callback.on_train_begin(args, state, control)
    source.transient(3 * MIB)
    logs: dict[str, float] = {"loss": 1.0}
    state.log_history.append(dict(logs))
    callback.on_log(args, state, control, logs=logs)
    callback.on_train_end(args, state, control)
    assert logs["loss"] == 1.0 and logs["gpumem/cuda0/peak_allocated_bytes"] == 3 * MIB
    assert state.log_history[-1]["gpumem/cuda0/peak_allocated_bytes"] == 3 * MIB

    class Handler:
        def __init__(self) -> None:
            self.callbacks: list[Any] = ["reporter"]

    class Trainer:
        def __init__(self) -> None:
            self.callback_handler = Handler()

    trainer = Trainer()
    attached = attach(trainer)
    assert trainer.callback_handler.callbacks == [attached, "reporter"]  # ahead of the reporters


def test_the_integrations_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.callbacks", "pytorch_lightning",
                 "pytorch_lightning.callbacks", "transformers"):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, None)
    for module, extra in (
        ("lightning", "pip install jupyter-gpumem[lightning]"),  # the distribution name: "gpumem" is another project
        ("huggingface", "pip install jupyter-gpumem[huggingface]"),
    ):
        monkeypatch.delitem(sys.modules, f"gpumem.integrations.{module}", raising=False)
        with pytest.raises(ImportError, match=extra.replace("[", r"\[").replace("]", r"\]")):
            importlib.import_module(f"gpumem.integrations.{module}")
