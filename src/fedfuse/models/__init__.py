"""Models with a declared head and layer structure (see :mod:`fedfuse.models.base`)."""

from fedfuse.models.base import FedModel, Layer, count_parameters, layer_index, module_kind
from fedfuse.models.registry import MODELS, ModelInfo, build_model, default_model, model_options, width_options

__all__ = [
    "MODELS",
    "FedModel",
    "Layer",
    "ModelInfo",
    "build_model",
    "count_parameters",
    "default_model",
    "layer_index",
    "model_options",
    "module_kind",
    "width_options",
]

from fedfuse._callable import make_callable  # fedfuse.models() → name: description

make_callable(__name__, lambda: {k: v.description for k, v in sorted(MODELS.items())})
