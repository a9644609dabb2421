"""Flax NNX training template: the JAX GPU codelab's Fashion-MNIST MLP, stage by stage.

For notebooks: `load_model(workdir)` restores a trained model, `predict(model, images)`
returns class probabilities and `class_names(workdir)` names them (`fmnist_flax.api`). They
are imported when first used, so the command line can answer a signal before JAX is imported.
"""

import importlib

__all__ = ["CLASS_NAMES", "class_names", "load_model", "predict"]


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module("fmnist_flax.api"), name)
    raise AttributeError(f"module 'fmnist_flax' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The module's names with the notebook API's, which `__getattr__` imports when used."""
    return sorted({*globals(), *__all__})
