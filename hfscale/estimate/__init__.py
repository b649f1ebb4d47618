"""Predict a strategy's peak memory per device before running it.

The model is built on the meta device (nothing is allocated or downloaded) and the peak is counted from its
parameters: ``weights + gradients + optimizer + activations + overhead - overlap``. The formulas, their sources and
how far each was checked are in docs/estimate.md. Importing this package imports neither torch nor transformers,
so a result row can carry a :class:`MemoryEstimate` cheaply.

- :mod:`~hfscale.estimate.shape`: what is read from the model (:class:`ModelShape`)
- :mod:`~hfscale.estimate.activations`: what a forward pass saves for the backward pass
- :mod:`~hfscale.estimate.optimizer`: optimizer states and step temporaries, per optimizer
- :mod:`~hfscale.estimate.states`: weights, gradients and optimizer states per engine (plain/DDP, ZeRO, FSDP)
- :mod:`~hfscale.estimate.peak`: the parts added into the peak (:func:`estimate_memory`)
- :mod:`~hfscale.estimate.fit`: whether it fits a budget (:func:`predict_fit`)
- :mod:`~hfscale.records.estimate`: :class:`MemoryEstimate`
- :mod:`~hfscale.commands.estimate`: ``hfscale estimate``
"""

from __future__ import annotations

from hfscale.estimate.activations import ActivationBytes, activation_bytes
from hfscale.estimate.fit import CUDA_CONTEXT_BYTES, FitPrediction, default_reserve_bytes, predict_fit, predicted_to_fit
from hfscale.estimate.optimizer import optimizer_state_bytes
from hfscale.estimate.peak import CUBLAS_WORKSPACES_BYTES, estimate_memory, model_states
from hfscale.estimate.shape import ModelShape, ParamInfo, describe_model, model_shape_from_module
from hfscale.estimate.states import ModelStates
from hfscale.records.estimate import MemoryEstimate

__all__ = [
    "CUBLAS_WORKSPACES_BYTES",
    "CUDA_CONTEXT_BYTES",
    "ActivationBytes",
    "FitPrediction",
    "MemoryEstimate",
    "ModelShape",
    "ModelStates",
    "ParamInfo",
    "activation_bytes",
    "default_reserve_bytes",
    "describe_model",
    "estimate_memory",
    "model_shape_from_module",
    "model_states",
    "optimizer_state_bytes",
    "predict_fit",
    "predicted_to_fit",
]
