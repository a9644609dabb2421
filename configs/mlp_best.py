"""The best MLP recipe: wider layers, warm-up + cosine AdamW, label smoothing, flips.

Run it:
    python main.py --config=configs/mlp_best.py
Reached on this machine (2 CPU cores, 2026-12-02): test accuracy 0.9112 on all 10,000 after
9,360 steps (the README's table gives the time).
"""

from fmnist_flax import config as default_config


def get_config():
    config = default_config.get_config()
    config.model.hidden = (1024, 512)
    config.batch_size = 256
    config.steps = 9_360  # 40 epochs of 234 batches
    config.log_every = 234  # once per epoch
    config.checkpoint_every = 2_340
    config.label_smoothing = 0.1
    config.augment.flip = True  # left-right mirror images stay in class
    config.optimizer.learning_rate = 1e-3
    config.optimizer.schedule = "warmup_cosine"
    config.optimizer.warmup_steps = 500
    config.optimizer.final_fraction = 0.01  # the cosine ends at 1% of the peak rate
    config.report = "basic"
    config.demonstrations = False  # a model of its own: none of the codelab's demonstrations
    return config
