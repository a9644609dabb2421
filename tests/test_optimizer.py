"""config.optimizer -> Optax: the default is the codelab's AdamW to the bit, every optimizer
builds and steps, clipping, L2 decay, decay masks, rate multipliers and schedules do what they
say, a project's own optimizer or schedule registers from its module, every mistake is one
line."""

from __future__ import annotations

import re

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import load_config

from fmnist_flax import optimizer
from fmnist_flax.config import get_config
from fmnist_flax.model import create_model
from fmnist_flax.runtime import param_groups, run_config
from fmnist_flax.runtime.errors import UserError


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
        (
            {"schedule": "warmup_rsqrt"},
            "--config.optimizer.warmup_steps=0 must be below --steps=400 and a whole number >= 1",
        ),
        ({"schedule": "one_cycle", "warmup_steps": 2.5}, "warmup_steps=2.5 must be below"),
        ({"schedule": "one_cycle", "warmup_steps": 400}, "(--config.optimizer.schedule=one_cycle)"),
        ({"decay_mask": "biases"}, "--config.optimizer.decay_mask='biases' is not one of all, k"),
        ({"lr_multipliers": ("head", 0.1)}, "lr_multipliers=('head', 0.1) must be (pattern, m"),
        ({"lr_multipliers": (("(head", 0.1),)}, "'(head' is not a regular expression (missing"),
        ({"lr_multipliers": (("head", -1.0),)}, "the multiplier of 'head' must be a number >= 0"),
        ({"lr_multipliers": ((3, 1.0),)}, "the pattern 3 must be a string"),
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


@pytest.fixture(scope="module")
def small_cnn() -> nnx.Module:
    """A real CNN, small: conv kernels and biases, BatchNorm scales and biases, dense layers."""
    config = get_config()
    config.model = ml_collections.ConfigDict({"name": "cnn", "features": (4,), "dense": 8})
    model = create_model(config, (8, 8, 1), 3, 0)
    # Biases start at 0, which decay leaves at 0: shifted, every parameter shows a decay.
    nnx.update(model, jax.tree.map(lambda p: p + 0.5, nnx.state(model, nnx.Param)))
    return model


def step_with(model: nnx.Module, config: ml_collections.ConfigDict, grad: float) -> dict:
    """Each parameter's name -> (before, after) one update of `config`'s optimizer on a copy
    of `model`, every gradient `grad`."""
    model = nnx.clone(model)
    params = nnx.state(model, nnx.Param)
    names = [param_groups.parameter_name(path) for path, _ in jax.tree.leaves_with_path(params)]
    before = jax.tree.leaves(params)  # the arrays: the Variables are updated in place
    tx = nnx.Optimizer(model, optimizer.create(config), wrt=nnx.Param)
    grads = jax.tree.map(lambda p: jnp.full_like(p, grad), params)
    nnx.jit(lambda tx, model, grads: tx.update(model, grads))(tx, model, grads)
    after = jax.tree.leaves(nnx.state(model, nnx.Param))
    return dict(zip(names, zip(before, after, strict=True), strict=True))


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "lion", "adafactor"])
def test_kernels_only_decay_leaves_biases_and_scales_untouched(small_cnn, name):
    """Under zero gradients an update is the weight decay alone: with decay_mask=kernels it
    moves every kernel and nothing else; with `all` (the default) the biases move too."""
    config = get_config()
    config.optimizer.update({"name": name, "weight_decay": 0.1, "decay_mask": "kernels"})
    optimizer.check_config(config.optimizer, config.steps)
    moved = {}
    for mask in ("kernels", "all"):
        config.optimizer.decay_mask = mask
        steps = step_with(small_cnn, config, 0.0)
        moved[mask] = {name for name, (a, b) in steps.items() if (a != b).any()}
    names = set(steps)
    assert {"norms/0/scale", "norms/0/bias", "convs/0/bias", "head/bias"} <= names
    assert moved["kernels"] == {n for n in names if n.endswith("/kernel")}
    assert moved["all"] == names


def test_rate_multipliers_scale_their_groups_first_pattern_first(small_cnn):
    config = get_config()
    config.optimizer.update({"name": "sgd", "learning_rate": 1.0, "weight_decay": 0.0})
    config.optimizer.lr_multipliers = (("head", 0.0), ("bias", 2.0), ("^convs/0/kernel$", 0.5))
    optimizer.check_config(config.optimizer, config.steps)
    for name, (before, after) in step_with(small_cnn, config, 1.0).items():
        factor = 0.0 if "head" in name else 2.0 if "bias" in name else 1.0
        factor = 0.5 if name == "convs/0/kernel" else factor
        np.testing.assert_allclose(before - after, factor, rtol=1e-6, err_msg=name)
    config.optimizer.lr_multipliers = (("haed", 0.1),)
    with pytest.raises(UserError, match="'haed' matches no parameter; their names are convs/0/"):
        nnx.Optimizer(nnx.clone(small_cnn), optimizer.create(config), wrt=nnx.Param)


def test_an_ensemble_member_with_a_mask_and_multipliers_updates_as_one_run_does():
    """Member 1's injected decay reaches only the kernels, and its multiplied biases move as a
    single run's do."""
    config, plain = get_config(), get_config()
    for c in (config, plain):
        c.optimizer.update({"decay_mask": "kernels", "lr_multipliers": (("bias", 3.0),)})
    config.ensemble.size, config.ensemble.weight_decay = 2, (0.0, 0.05)
    plain.optimizer.weight_decay = 0.05
    params = {
        "kernel": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4),
        "bias": jnp.linspace(-1.0, 1.0, 4),
    }
    grads = jax.tree.map(lambda p: 0.1 * p + 0.2, params)
    member, reference = optimizer.create(config, 1), optimizer.create(plain)
    state, expected_state = member.init(params), reference.init(params)
    for _ in range(2):
        got, state = jax.jit(member.update)(grads, state, params)
        want, expected_state = jax.jit(reference.update)(grads, expected_state, params)
        np.testing.assert_array_equal(got["kernel"], want["kernel"])
        # XLA folds the single run's constant rate into the multiplier: one rounding less.
        np.testing.assert_array_max_ulp(got["bias"], want["bias"], maxulp=1)


def test_warmup_rsqrt_and_one_cycle_follow_their_shapes():
    config = get_config()
    config.steps, peak = 100, config.optimizer.learning_rate
    config.optimizer.update({"schedule": "warmup_rsqrt", "warmup_steps": 10})
    optimizer.check_config(config.optimizer, config.steps)
    rate = optimizer.learning_rate(config)
    got = [float(rate(step)) for step in (0, 5, 10, 40, 1000)]
    np.testing.assert_allclose(got, [0.0, peak / 2, peak, peak / 2, peak / 10], rtol=1e-6)
    config.optimizer.update({"schedule": "one_cycle", "final_fraction": 0.1})
    rate = optimizer.learning_rate(config)
    got = [float(rate(step)) for step in (0, 5, 10, 55, 100, 200)]
    want = [0.0, peak / 2, peak, 0.55 * peak, 0.1 * peak, 0.1 * peak]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_resume_may_change_steps_only_under_a_schedule_that_does_not_end_there():
    """one_cycle (like warmup_cosine) decays over --steps; warmup_rsqrt and constant do not."""
    for name, refused in (("one_cycle", True), ("warmup_rsqrt", False), ("constant", False)):
        saved = get_config()
        saved.optimizer.update({"schedule": name, "warmup_steps": 10})
        now = ml_collections.ConfigDict(saved.to_dict())
        now.steps = 800
        defaults = get_config().to_dict()
        changes = run_config.training_changes(saved.to_dict(), now.to_dict(), defaults)
        changed = [c["field"] for c in changes]
        assert changed == (["steps"] if refused else []), name


def test_a_project_registers_its_own_schedule_and_optimizer(registries):
    """What a project's module does on import: decorate, and its names become config values
    (its new fields checked by its own code, in one line)."""

    @optimizer.schedule("halving_in_test", fields=("halve_every",))
    def halving(opt, steps):
        if not isinstance(opt.halve_every, int) or opt.halve_every < 1:
            raise UserError(f"--config.optimizer.halve_every={opt.halve_every!r} must be >= 1")
        return optax.exponential_decay(opt.learning_rate, opt.halve_every, 0.5, staircase=True)

    optimizer.register("rmsprop_in_test", takes=("momentum",))(optimizer._l2(optax.rmsprop))
    config = get_config()
    config.optimizer.update(
        {"name": "rmsprop_in_test", "schedule": "halving_in_test", "momentum": 0.9}
    )
    with pytest.raises(
        UserError, match=r"schedule=halving_in_test reads config\.optimizer\.halve_every"
    ):
        optimizer.check_config(config.optimizer, config.steps)
    config.optimizer.halve_every = 0
    with pytest.raises(UserError, match=r"^--config\.optimizer\.halve_every=0 must be >= 1$"):
        optimizer.check_config(config.optimizer, config.steps)
    config.optimizer.halve_every = 2
    optimizer.check_config(config.optimizer, config.steps)
    rate = optimizer.learning_rate(config)
    assert [float(rate(s)) for s in (1, 2, 5)] == pytest.approx([3e-3, 1.5e-3, 7.5e-4])
    [update] = updates(optimizer.create(config), steps=1)
    assert all(np.isfinite(leaf).all() and leaf.any() for leaf in jax.tree.leaves(update))
