"""A tiny run for tests and for checking an install: 20 steps, seconds on a CPU.

Run it:
    python main.py --config=configs/smoke.py
"""

from configs import default


def get_config():
    config = default.get_config()
    config.steps = 20
    config.log_every = 5
    config.checkpoint_every = 10
    config.report = "none"
    return config
