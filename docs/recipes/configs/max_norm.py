"""The codelab's MLP, each unit's incoming weights kept to an L2 norm of at most 1
(my_constraints.py): python main.py --config=configs/max_norm.py"""

from fmnist_flax import config as default_config


def get_config():
    config = default_config.get_config()
    config.imports = ("my_constraints",)
    config.max_norm = 1.0  # my_constraints.max_norm's bound
    config.steps, config.log_every, config.report = 20, 10, "none"
    return config
