"""Flax NNX training template: the JAX GPU codelab's Fashion-MNIST MLP, stage by stage.

For notebooks: `load_model(workdir)` restores a trained model, `predict(model, images)`
returns class probabilities and `class_names(workdir)` names them.
"""

from fmnist_flax import config, datasets, evaluate, model
from fmnist_flax.datasets import IDX_DATASETS
from fmnist_flax.runtime import inference
from fmnist_flax.runtime.inference import class_names, load_model, predict

# What the runtime's inference calls of this template (it imports none of the template's modules).
inference.use(
    inference.Template(
        with_defaults=config.with_defaults,
        create_model=model.create_model,
        compute_dtypes=tuple(model.COMPUTE_DTYPES),
        load_dataset=datasets.load,
        evaluate=evaluate.evaluate,
    )
)

CLASS_NAMES = IDX_DATASETS["fashion_mnist"].class_names  # the default dataset's classes

__all__ = ["CLASS_NAMES", "class_names", "load_model", "predict"]
