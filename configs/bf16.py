"""The codelab's run with bfloat16 compute (params, optimizer state and logits stay float32).

Run it:
    python main.py --config=configs/bf16.py
Reached on this machine (2 CPU cores): see README "Configs"; this CPU has no fast bfloat16
path, so it is slower than float32 here and faster only on hardware that has one.
"""

from fmnist_flax import config as default_config


def get_config():
    config = default_config.get_config()
    config.compute_dtype = "bfloat16"
    return config
