"""The codelab's values: MLP 784-256-128-10, AdamW(3e-3, wd 1e-4), batch 512, 400 steps.

Run it:
    python main.py --config=configs/default.py --steps=400
Override any field with --config.FIELD=VALUE or the shorthand flags (--steps, --compute_dtype...).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0  # data shuffle and parameter init
    config.data_dir = ""  # "" searches the cache, Debian's directory, then downloads
    config.batch_size = 512  # train and evaluation batches; every step has this shape
    config.steps = 400  # optimizer updates; every epoch visits the train set in a fresh order
    config.log_every = 25  # metrics reach the host only at these steps (and the first and last)
    config.compute_dtype = "float32"  # float32 | bfloat16; params always stay float32
    config.checkpoint_every = 100  # Orbax saves every this many steps, at the end and on SIGTERM
    config.max_to_keep = 3  # newest checkpoints kept in <workdir>/checkpoints
    config.fused_steps = True  # several steps per compiled call (False: one step per call)
    config.label_smoothing = 0.0  # optax.smooth_labels on the one-hot targets when > 0
    config.augment = ml_collections.ConfigDict()
    config.augment.max_shift = 0  # random shifts of up to this many pixels, on the device
    config.augment.flip = False  # random left-right mirroring, on the device
    config.report = "full"  # full | basic (no extra timing comparisons) | none (no report/)
    config.param_sharding = "replicated"  # replicated | fsdp (split over the `data` mesh axis)

    config.model = ml_collections.ConfigDict()
    config.model.name = "mlp"  # a key of fmnist_flax.model.MODELS; the other fields are its args
    config.model.hidden = (256, 128)  # hidden layer widths between 784 inputs and 10 classes

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.learning_rate = 3e-3  # AdamW
    config.optimizer.weight_decay = 1e-4  # AdamW's decoupled weight decay
    config.optimizer.schedule = "constant"  # constant | warmup_cosine (decays over `steps`)
    config.optimizer.warmup_steps = 0  # warmup_cosine: linear warm-up from 0 to the peak
    config.optimizer.final_fraction = 0.01  # warmup_cosine: the last rate, as a peak fraction
    return config
