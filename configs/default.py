"""The codelab's values: MLP 784-256-128-10, AdamW(3e-3, wd 1e-4), batch 512, 400 steps.

Run it:
    python main.py --config=configs/default.py --steps=400
The values live in the package (fmnist_flax/config.py), so the installed console script runs
from any directory; every config here starts from them. Override any field with
--config.FIELD=VALUE or the shorthand flags (--steps, --compute_dtype...).
"""

from fmnist_flax.config import get_config

__all__ = ["get_config"]
