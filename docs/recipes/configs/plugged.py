"""Logistic regression on stripes, plain SGD, a halving rate: every part from my_project.py.
python main.py --config=configs/plugged.py"""

import ml_collections

from fmnist_flax import config as default_config


def get_config():
    config = default_config.get_config()
    config.imports = ("my_project",)
    config.model = ml_collections.ConfigDict({"name": "logistic"})
    config.dataset.name = "stripes"
    config.optimizer.name, config.optimizer.schedule = "sgd_plain", "halving"
    config.optimizer.learning_rate, config.batch_size = 0.1, 32
    config.steps, config.log_every, config.report = 20, 10, "none"
    return config
