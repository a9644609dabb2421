"""`python -m fmnist_flax --steps=400`: the same command line as `main.py`."""

from fmnist_flax import launch

launch.main()
