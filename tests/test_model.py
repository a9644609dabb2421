"""The NNX MLP: shapes, dtypes, initialisation and the parameter count of the codelab."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import default
from fmnist_flax import model as model_lib


def test_codelab_architecture_and_parameter_count():
    model = model_lib.MLP(rngs=nnx.Rngs(0))
    assert model_lib.count_params(model) == 235_146
    shapes = [(layer.kernel.shape, layer.bias.shape) for layer in model.layers]
    assert shapes == [((784, 256), (256,)), ((256, 128), (128,)), ((128, 10), (10,))]
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        assert leaf.dtype == jnp.float32


def test_he_normal_init_is_untruncated_with_std_sqrt_2_over_fan_in():
    model = model_lib.MLP(hidden=(1024, 1024), rngs=nnx.Rngs(0))
    for layer in model.layers[:2]:
        kernel = np.asarray(layer.kernel[...])
        std = np.sqrt(2.0 / kernel.shape[0])
        assert abs(kernel.std() / std - 1) < 0.01
        assert np.abs(kernel).max() > 3 * std  # a truncated normal stops at 2 std
        np.testing.assert_array_equal(layer.bias[...], 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compute_dtype_casts_activations_and_returns_float32_logits(dtype):
    model = model_lib.MLP(compute_dtype=dtype, rngs=nnx.Rngs(0))
    assert model.compute_dtype == dtype
    x = jnp.ones((3, 784))
    hidden = jax.make_jaxpr(model.layers[0])(x.astype(dtype)).out_avals[0]
    assert hidden.dtype == dtype
    logits = model(x)
    assert logits.shape == (3, 10) and logits.dtype == jnp.float32


def test_create_model_follows_the_config_and_seed():
    config = default.get_config()
    config.model.hidden = (32,)
    config.compute_dtype = "bfloat16"
    model = model_lib.create_model(config)
    assert model.compute_dtype == jnp.bfloat16
    assert model_lib.count_params(model) == 784 * 32 + 32 + 32 * 10 + 10
    again = model_lib.create_model(config)
    other = model_lib.create_model(config, seed=1)
    k = model.layers[0].kernel[...]
    np.testing.assert_array_equal(k, again.layers[0].kernel[...])
    assert not np.array_equal(k, other.layers[0].kernel[...])
