"""The notebook API (`load_model`, `predict`, `class_names`, `CLASS_NAMES`), and the template's
parts handed to the runtime's inference, which imports none of the template's modules.

Importing this module is what makes `runtime.inference` able to rebuild a saved model: the
package's `__init__`, the command line and the trainer import it.
"""

from fmnist_flax import config, datasets, evaluate, model
from fmnist_flax.runtime import inference
from fmnist_flax.runtime.inference import class_names, load_model, predict

inference.use(
    inference.Template(
        with_defaults=config.with_defaults,
        create_model=model.create_model,
        compute_dtypes=tuple(model.COMPUTE_DTYPES),
        load_dataset=datasets.load,
        evaluate=evaluate.evaluate,
        # Checkpoints saved before they recorded their dataset all trained on Fashion-MNIST.
        unrecorded_dataset={
            "name": "fashion_mnist",
            "title": datasets.IDX_DATASETS["fashion_mnist"].title,
            "class_names": list(datasets.IDX_DATASETS["fashion_mnist"].class_names),
            "image_shape": [28, 28],
        },
    )
)

CLASS_NAMES = datasets.IDX_DATASETS["fashion_mnist"].class_names  # the default dataset's classes

__all__ = ["CLASS_NAMES", "class_names", "load_model", "predict"]
