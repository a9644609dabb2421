"""Parity: the NNX model, loss, gradients and AdamW step equal the codelab's pure-PyTree twin."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import forward, load_config
from flax import nnx

from fmnist_flax import train
from fmnist_flax.codelab import demonstrations as codelab
from fmnist_flax.codelab import reference
from fmnist_flax.model import MLP

RTOL = 1e-6  # float32 parity
TASK = train.Config(load_config("default"))  # the codelab's loss: no label smoothing
BF16_ATOL = 0.05  # bfloat16 vs float32 logits: 8 mantissa bits through three layers
mlp = jax.jit(reference.mlp, static_argnums=2)  # one program (eagerly, each op compiles)


@pytest.fixture(scope="module")
def batch(real_dataset):
    x = reference.flat_images(real_dataset.train_images[:512])  # the codelab's (512, 784)
    return jnp.asarray(x), jnp.asarray(real_dataset.train_labels[:512].astype(np.int32))


def by_name(model_grads: nnx.State) -> dict[str, jax.Array]:
    """NNX gradient state -> the reference's {w1, b1, ...} names."""
    flat = dict(nnx.to_flat_state(model_grads))
    return {
        f"{'w' if kind == 'kernel' else 'b'}{i + 1}": flat[("layers", i, kind)][...]
        for i in range(3)
        for kind in ("kernel", "bias")
    }


def assert_trees_close(a, b, rtol=RTOL, atol=0.0):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def test_logits_loss_and_grads_match_the_reference(batch):
    x, y = batch
    model = MLP(rngs=nnx.Rngs(0))
    params = reference.params_from_model(model)
    logits = forward(model, x)
    np.testing.assert_allclose(logits, mlp(params, x, jnp.float32), rtol=RTOL, atol=1e-6)
    # Each side compiled as one program (eagerly, every op would compile on its own).
    (loss, aux), grads = nnx.jit(
        lambda m: nnx.value_and_grad(train.loss_fn, has_aux=True)(m, x, y, TASK)
    )(model)
    (ref_loss, ref_aux), ref_grads = jax.jit(
        jax.value_and_grad(reference.loss_with_metrics, has_aux=True)
    )(params, (x, y))
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    np.testing.assert_allclose(aux["accuracy"], ref_aux["accuracy"], rtol=RTOL)
    assert_trees_close(by_name(grads), ref_grads, atol=1e-8)


def test_one_adamw_step_gives_the_same_params_and_metrics(batch):
    x, y = batch
    config = load_config("default")
    model = MLP(rngs=nnx.Rngs(0))
    params = jax.tree.map(np.array, reference.params_from_model(model))  # the step donates
    tx = optax.adamw(config.optimizer.learning_rate, weight_decay=config.optimizer.weight_decay)
    ref_step = reference.make_train_step(tx, jnp.float32)
    ref_params, _, ref_metrics = ref_step(params, tx.init(params), (x, y))
    metrics = train.jit_train_step(model, train.create_optimizer(model, config), x, y, TASK)
    assert_trees_close(reference.params_from_model(model), ref_params, atol=1e-7)
    # Every metric the codelab's step reports; the task may define more (docs/extending.md).
    assert_trees_close({name: metrics[name] for name in ref_metrics}, ref_metrics)
    # The step really moved the weights (by about the learning rate: Adam's first step is ~lr).
    moved = np.abs(np.asarray(ref_params["w1"] - params["w1"])).max()
    assert 0.5 * config.optimizer.learning_rate < moved < 2.0 * config.optimizer.learning_rate


def test_bfloat16_logits_match_the_reference_and_stay_near_float32(batch):
    x, _ = batch
    model = MLP(compute_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    params = reference.params_from_model(model)
    logits, float32 = forward(model, x), mlp(params, x, jnp.float32)
    np.testing.assert_allclose(logits, mlp(params, x, jnp.bfloat16), rtol=RTOL)
    np.testing.assert_allclose(logits, float32, atol=BF16_ATOL)
    assert not np.array_equal(logits, float32)  # bf16 really was used


def test_reference_init_has_the_codelab_shapes_and_scale():
    params = reference.init_mlp_params(jax.random.key(1))
    assert sum(p.size for p in params.values()) == 235_146
    assert abs(float(params["w1"].std()) / np.sqrt(2 / 784) - 1) < 0.02


def test_the_gradient_checks_sgd_step_matches_the_codelabs(batch):
    """The codelab's hand-written SGD step (pure PyTree) and the NNX gradient check's agree."""
    x, y = batch
    model = MLP(rngs=nnx.Rngs(0))
    config = load_config("default")
    config.optimizer.learning_rate = 3e-3
    _, check = codelab.gradient_check(model, x, y, config)
    params = reference.params_from_model(model)
    stepped, loss = jax.jit(reference.sgd_step)(params, (x, y), 3e-3)
    np.testing.assert_allclose(loss, check["loss"], rtol=RTOL)
    after = jax.jit(reference.cross_entropy_loss)(stepped, (x, y))
    np.testing.assert_allclose(after, check["loss_after_one_sgd_step"], rtol=1e-5)
    assert float(after) < float(loss)
    np.testing.assert_array_equal(params["w1"], model.layers[0].kernel[...])  # untouched
