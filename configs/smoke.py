"""A tiny run for tests and for checking an install: 20 steps, seconds on a CPU.

Run it:
    python main.py --config=configs/smoke.py
"""

from fmnist_flax import config as default_config


def get_config():
    config = default_config.get_config()
    config.steps = 20
    config.log_every = 5
    config.checkpoint_every = 10
    config.checkpoint_min_interval_secs = 0.0  # a run of seconds still saves at 10 and 20
    config.report = "none"
    return config
