"""Flax NNX training template: the JAX GPU codelab's Fashion-MNIST MLP, stage by stage."""
