"""Train and evaluate the Flax NNX MLP on Fashion-MNIST: `python main.py --steps=400`."""

from fmnist_flax import launch

if __name__ == "__main__":
    launch.main()
