"""`python -m fmnist_flax --steps=400`: the same command line as `main.py`."""

from fmnist_flax import cli

if __name__ == "__main__":  # imported (by a tool, a test), it runs nothing
    cli.run()
