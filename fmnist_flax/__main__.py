"""`python -m fmnist_flax --steps=400`: the same command line as `main.py`."""

from fmnist_flax import launch

if __name__ == "__main__":  # imported (by a tool, a test), it runs nothing
    launch.main()
