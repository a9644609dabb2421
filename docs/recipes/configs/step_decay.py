"""The codelab's MLP on my_schedules.py's step decay, weight decay on its kernels only:
python main.py --config=configs/step_decay.py"""

import my_schedules  # noqa: F401  (registers the "step_decay" schedule)

from fmnist_flax import config as default_config


def get_config():
    config = default_config.get_config()
    config.optimizer.schedule = "step_decay"
    config.optimizer.halve_every = 5  # step_decay's own field
    config.optimizer.decay_mask, config.optimizer.weight_decay = "kernels", 0.05
    config.steps, config.log_every, config.report = 20, 10, "basic"
    return config
