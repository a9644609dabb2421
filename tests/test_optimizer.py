"""config.optimizer -> Optax: the default is the codelab's AdamW to the bit, every optimizer
builds and steps, clipping and L2 decay do what they say, every mistake is one line."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import load_config

from fmnist_flax import optimizer
from fmnist_flax.config import get_config
from fmnist_flax.errors import UserError


def tree(seed: int) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(seed), 2)
    return {"w": jax.random.normal(keys[0], (5, 3)), "b": jax.random.normal(keys[1], (3,))}


def updates(tx: optax.GradientTransformation, steps: int = 3) -> list[dict[str, jax.Array]]:
    """The updates `tx` makes over a few steps from fixed params and gradients."""
    params, out = tree(0), []
    state = tx.init(params)
    for step in range(steps):
        update, state = tx.update(tree(step + 1), state, params)
        params = optax.apply_updates(params, update)
        out.append(update)
    return out


def test_the_default_is_the_codelabs_adamw_to_the_bit():
    config = load_config("default")
    expected = updates(optax.adamw(3e-3, weight_decay=1e-4))
    for got, want in zip(updates(optimizer.create(config)), expected, strict=True):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("adamw", {"b1": 0.8, "b2": 0.99, "nesterov": True}),
        ("adam", {"b1": 0.8, "nesterov": True}),
        ("sgd", {"momentum": 0.9, "nesterov": True}),
        ("lion", {"b1": 0.95, "b2": 0.98}),
        ("adafactor", {"momentum": 0.9}),
    ],
)
def test_every_optimizer_builds_with_its_own_fields_and_steps(name, fields):
    config = load_config("default")
    config.optimizer.name = name
    config.optimizer.update(fields)
    optimizer.check_config(config.optimizer, config.steps)
    steps = updates(optimizer.create(config))
    assert all(np.isfinite(leaf).all() for step in steps for leaf in jax.tree.leaves(step))
    assert any(np.abs(leaf).max() > 0 for leaf in jax.tree.leaves(steps[-1]))


def test_clipping_bounds_the_gradient_norm_and_sgd_decay_is_l2():
    config = load_config("default")
    config.optimizer.update({"name": "sgd", "learning_rate": 1.0, "weight_decay": 0.0})
    config.optimizer.clip_norm = 0.5
    [update] = updates(optimizer.create(config), steps=1)
    assert float(optax.tree.norm(update)) == pytest.approx(0.5, rel=1e-6)
    config.optimizer.clip_norm, config.optimizer.weight_decay = 0.0, 0.1
    params = tree(0)
    tx = optimizer.create(config)
    zero = jax.tree.map(jnp.zeros_like, params)
    update, _ = tx.update(zero, tx.init(params), params)
    for u, p in zip(jax.tree.leaves(update), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(u, -0.1 * p, rtol=1e-6)


def test_a_schedule_follows_the_config():
    config = load_config("mlp_best")
    schedule = optimizer.learning_rate(config)
    assert float(schedule(0)) == 0.0
    assert float(schedule(config.optimizer.warmup_steps)) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"name": "adagrad"}, "--config.optimizer.name='adagrad' is not one of adamw, adam, sgd"),
        ({"momentum": 0.9}, "momentum=0.9: optimizer 'adamw' does not take momentum; its own"),
        ({"name": "lion", "nesterov": True}, "optimizer 'lion' does not take nesterov"),
        ({"weight_decay": float("nan")}, "--config.optimizer.weight_decay=nan must be >= 0"),
        ({"learning_rate": float("inf")}, "--learning_rate=inf must be positive"),
        ({"learning_rate": 0.0}, "--learning_rate=0.0 must be positive"),
        ({"clip_norm": -1.0}, "--config.optimizer.clip_norm=-1.0 must be >= 0"),
        ({"name": "sgd", "momentum": 1.5}, "--config.optimizer.momentum=1.5 must be in [0, 1)"),
        ({"b2": -0.1}, "--config.optimizer.b2=-0.1 must be in [0, 1)"),
        ({"accumulate": 0}, "--config.optimizer.accumulate=0 must be >= 1"),
        ({"accumulate": 2.5}, "--config.optimizer.accumulate=2.5 must be a whole number"),
        ({"nesterov": "yes"}, "--config.optimizer.nesterov='yes' must be True or False"),
        ({"schedule": "linear"}, "--config.optimizer.schedule='linear' is not one of constant"),
        ({"schedule": "warmup_cosine", "warmup_steps": 400}, "warmup_steps=400 must be below"),
        ({"betas": (0.9, 0.99)}, "config.optimizer has no field 'betas'; its fields are name,"),
        ({"final_fraction": -5.0}, "--config.optimizer.final_fraction=-5.0 must be in [0, 1]"),
        ({"final_fraction": float("nan")}, "--config.optimizer.final_fraction=nan must be in"),
        ({"final_fraction": float("inf")}, "--config.optimizer.final_fraction=inf must be in"),
        ({"final_fraction": 1.5}, "--config.optimizer.final_fraction=1.5 must be in [0, 1]"),
    ],
)
def test_every_optimizer_mistake_is_one_line(changes, message):
    opt = ml_collections.ConfigDict({**load_config("default").optimizer.to_dict(), **changes})
    with pytest.raises(UserError, match=re.escape(message)) as exc:
        optimizer.check_config(opt, 400)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_an_ensemble_members_injected_rate_and_decay_update_as_plain_optax_does(name):
    """Member k's learning rate and weight decay are arrays in its optimizer state (one
    compiled step serves a sweep), and its updates equal the plain optimizer's to the bit."""
    config = get_config()
    config.optimizer.name = name
    config.ensemble.size, config.ensemble.learning_rate = 2, (1e-3, 2e-2)
    config.ensemble.weight_decay = (0.0, 0.05)
    plain = get_config()
    plain.optimizer.name, plain.optimizer.learning_rate, plain.optimizer.weight_decay = (
        name,
        2e-2,
        0.05,
    )
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}
    grads = {"w": jnp.linspace(-0.3, 0.5, 12).reshape(3, 4)}
    member, reference = optimizer.create(config, 1), optimizer.create(plain)
    state, expected_state = member.init(params), reference.init(params)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(2e-2)
    for _ in range(3):
        got, state = jax.jit(member.update)(grads, state, params)
        want, expected_state = jax.jit(reference.update)(grads, expected_state, params)
        np.testing.assert_array_equal(got["w"], want["w"])
