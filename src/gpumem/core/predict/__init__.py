"""Will it fit? Predict a cell's or a function's memory with a dry run on fake tensors, and search the
largest batch that fits. Needs torch (imported only when a prediction is asked for)."""

from __future__ import annotations

from gpumem.core.predict.batch import BatchSearch
from gpumem.core.predict.dryrun import predict, predict_source, search_batch
from gpumem.core.predict.guards import Refusal
from gpumem.core.predict.result import DevicePrediction, Prediction

__all__ = ["BatchSearch", "DevicePrediction", "Prediction", "Refusal", "predict", "predict_source", "search_batch"]
