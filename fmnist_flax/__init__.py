"""Flax NNX training template: the JAX GPU codelab's Fashion-MNIST MLP, stage by stage.

For notebooks: `load_model(workdir)` restores a trained model, `predict(model, images)`
returns class probabilities.
"""

from fmnist_flax.checkpoint import load_model
from fmnist_flax.data import CLASS_NAMES
from fmnist_flax.evaluate import predict

__all__ = ["CLASS_NAMES", "load_model", "predict"]
