"""Flax NNX training template: the JAX GPU codelab's Fashion-MNIST MLP, stage by stage.

For notebooks: `load_model(workdir)` restores a trained model, `predict(model, images)`
returns class probabilities and `class_names(workdir)` names them. They are imported when
first used, so the command line can answer a signal before JAX is imported.
"""

import importlib

_HOMES = {
    "class_names": "fmnist_flax.inference",
    "load_model": "fmnist_flax.inference",
    "predict": "fmnist_flax.evaluate",
}

__all__ = ["CLASS_NAMES", "class_names", "load_model", "predict"]


def __getattr__(name: str) -> object:
    if name == "CLASS_NAMES":  # the default dataset's classes
        return (
            importlib.import_module("fmnist_flax.datasets")
            .IDX_DATASETS["fashion_mnist"]
            .class_names
        )
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'fmnist_flax' has no attribute {name!r}")
