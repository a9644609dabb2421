"""The codelab's demonstrations: the gradient check and the extension that adds them to a run."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from fmnist_flax import codelab
from fmnist_flax.model import MLP


def test_gradient_check_reports_matching_trees(quick_config):
    model = MLP(rngs=nnx.Rngs(0))
    x = jnp.ones((4, 784))
    y = jnp.arange(4)
    table, check = codelab.gradient_check(model, x, y, quick_config.optimizer.learning_rate)
    assert check["trees_match"] and check["grad_vs_value_and_grad"] == 0.0
    assert [row[0] for row in table.rows][-1] == "layers.2.kernel"
    assert check["loss_after_one_sgd_step"] < check["loss"]  # a step downhill
