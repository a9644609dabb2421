"""The patch model of my_parallel.py, its MLP block split over the `model` mesh axis:
python main.py --config=configs/patches.py --config.mesh.model=4"""

import ml_collections

from fmnist_flax import config as default_config


def get_config():
    config = default_config.get_config()
    config.imports = ("my_parallel",)
    config.model = ml_collections.ConfigDict({"name": "patches", "embed": 64, "mlp": 128})
    config.mesh.rules = (("mlp", "model"), ("embed", None), ("patch", None), ("classes", None))
    config.steps, config.log_every, config.report = 20, 10, "none"
    return config
