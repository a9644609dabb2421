"""Flax NNX training template: the JAX GPU codelab's Fashion-MNIST MLP, stage by stage.

For notebooks: `load_model(workdir)` restores a trained model, `predict(model, images)`
returns class probabilities and `class_names(workdir)` names them.
"""

from fmnist_flax.datasets import IDX_DATASETS
from fmnist_flax.evaluate import predict
from fmnist_flax.runtime.inference import class_names, load_model

CLASS_NAMES = IDX_DATASETS["fashion_mnist"].class_names  # the default dataset's classes

__all__ = ["CLASS_NAMES", "class_names", "load_model", "predict"]
