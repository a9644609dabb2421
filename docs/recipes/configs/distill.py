"""A small MLP (784-64-10) taught by a trained run's model (--config.teacher=WORKDIR) beside the
labels, 60 steps: python main.py --config=configs/distill.py --config.teacher=runs/teacher"""

import ml_collections

from fmnist_flax import config as default_config


def get_config():
    config = default_config.get_config()
    config.imports = ("my_distillation",)
    config.model = ml_collections.ConfigDict({"name": "mlp", "hidden": (64,)})
    config.teacher = ""  # the teacher's workdir: required
    config.distill_weight, config.temperature = 1.0, 2.0
    config.steps, config.log_every, config.checkpoint_every = 60, 20, 30
    config.report, config.demonstrations = "none", False
    return config
