"""The NNX MLP: shapes, dtypes, initialisation and the parameter count of the codelab."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import forward, load_config
from flax import nnx

from fmnist_flax import model as model_lib
from fmnist_flax.runtime import model_build, parallel, tables
from fmnist_flax.runtime.errors import UserError


def test_codelab_architecture_and_parameter_count():
    model = model_lib.MLP(rngs=nnx.Rngs(0))
    assert tables.count_params(model) == 235_146
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
    x = jnp.ones((3, 28, 28, 1))
    hidden = jax.make_jaxpr(model.layers[0])(x.reshape(3, -1).astype(dtype)).out_avals[0]
    assert hidden.dtype == dtype
    logits = forward(model, x)
    assert logits.shape == (3, 10) and logits.dtype == jnp.float32


def test_create_model_follows_the_config_and_seed():
    config = load_config("default")
    config.model.hidden = (32,)
    config.compute_dtype = "bfloat16"
    model = model_lib.create_model(config, (28, 28, 1), 10)
    assert model.compute_dtype == jnp.bfloat16
    assert tables.count_params(model) == 784 * 32 + 32 + 32 * 10 + 10
    again = model_lib.create_model(config, (28, 28, 1), 10)
    other = model_lib.create_model(config, (28, 28, 1), 10, seed=1)
    k = model.layers[0].kernel[...]
    np.testing.assert_array_equal(k, again.layers[0].kernel[...])
    assert not np.array_equal(k, other.layers[0].kernel[...])


@pytest.mark.parametrize("name", ["default", "cnn"])
def test_the_init_compiled_for_speed_of_compiling_gives_the_same_bits(name):
    """create_model compiles the init with model_build.INIT_COMPILER_OPTIONS; a compile with
    XLA's default options must give the same values."""
    config = load_config(name)
    model = model_lib.create_model(config, (28, 28, 1), 10, seed=5)
    models, dtypes = model_lib.MODELS, model_lib.COMPUTE_DTYPES
    static = model_build.static_args(models, dtypes, config, (28, 28, 1), 10)
    default = jax.jit(lambda seed: nnx.state(model_build._construct(*static, seed)))
    expected = default(jnp.asarray(5, jnp.uint32))
    for got, want in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(expected), strict=True):
        if jnp.issubdtype(got.dtype, jax.dtypes.prng_key):  # the CNN's dropout stream
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(got, want)


def output(model: nnx.Module, shape: tuple[int, ...]) -> tuple[tuple[int, ...], jnp.dtype]:
    """The shape and dtype of a model's logits for float32 input of `shape`, traced only."""
    out = nnx.eval_shape(lambda m, x: m(x), model, jax.ShapeDtypeStruct(shape, jnp.float32))
    return out.shape, out.dtype


def test_models_take_their_shape_and_classes_from_the_data():
    config = load_config("cnn")
    model = model_lib.create_model(config, (20, 12, 1), 3)
    assert output(model, (2, 20, 12, 1)) == ((2, 3), jnp.float32)
    mlp = model_lib.create_model(load_config("default"), (5, 7, 1), 4)
    assert mlp.layers[0].kernel.shape == (35, 256) and output(mlp, (1, 5, 7, 1))[0] == (1, 4)


@pytest.mark.parametrize("name", ["default", "cnn"])
def test_every_model_takes_colour_images(name):
    """(H, W, C) with C = 3: the MLP flattens every channel, the CNN's first conv takes C."""
    model = model_lib.create_model(load_config(name), (32, 32, 3), 10)
    assert output(model, (2, 32, 32, 3)) == ((2, 10), jnp.float32)
    if name == "default":
        assert model.layers[0].kernel.shape == (32 * 32 * 3, 256)
    else:
        assert model.convs[0].kernel.shape == (3, 3, 3, 32)
    assert model.image_shape == (32, 32, 3)


@pytest.mark.parametrize(
    ("name", "field", "value", "message"),
    [
        ("default", "hidden", (256, 0), "--config.model.hidden=(256, 0) must be a tuple of pos"),
        ("default", "hidden", 256, "--config.model.hidden=256 must be a tuple of positive"),
        ("default", "hiden", (8,), "model 'mlp' takes no field 'hiden'; its fields are hidden"),
        ("default", "name", "resnet", "--config.model.name='resnet' is not one of mlp, cnn"),
        ("cnn", "features", (), "--config.model.features=() must be a tuple of positive"),
        ("cnn", "features", (8,) * 5, "5 blocks leave nothing of 28x28"),
        ("cnn", "features", (8,) * 6, "halves the image's height and width, and 6 blocks"),
        ("cnn", "dropout", 1.5, "--config.model.dropout=1.5 must be in"),
    ],
)
def test_each_model_checks_its_own_fields_in_one_line(name, field, value, message):
    config = load_config(name)
    config.model = ml_collections.ConfigDict({**config.model.to_dict(), field: value})
    with pytest.raises(UserError, match=re.escape(message)) as exc:
        model_lib.create_model(config, (28, 28, 1), 10)
    assert "\n" not in str(exc.value)


def test_a_model_without_its_own_check_fails_in_one_line_not_a_traceback(registries):
    class Tiny(nnx.Module):
        def __init__(self, width: int = 4, *, image_shape, num_classes, compute_dtype, rngs):
            self.head = nnx.Linear(math.prod(image_shape), width * num_classes, rngs=rngs)

    model_lib.MODELS["tiny_in_test"] = Tiny
    config = load_config("default")
    config.model = ml_collections.ConfigDict({"name": "tiny_in_test", "width": -1})
    with pytest.raises(
        UserError, match=r"model 'tiny_in_test' cannot be built from --config\.model: "
    ):
        model_lib.create_model(config, (28, 28, 1), 10)


def test_a_model_annotated_with_with_partitioning_builds_without_a_mesh(registries):
    """The issue's case: `nnx.with_partitioning` weights built by create_model (no mesh, no
    eager sharding), carrying the config's rules, then laid out on a mesh by parallel."""

    class Patches(nnx.Module):
        def __init__(self, *, image_shape, num_classes, compute_dtype, rngs):
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("patch", "embed"))
            self.embed = nnx.Linear(
                math.prod(image_shape), num_classes, kernel_init=init, rngs=rngs
            )

    model_lib.MODELS["patches_in_test"] = Patches
    config = load_config("default")
    config.model = ml_collections.ConfigDict({"name": "patches_in_test"})
    model = model_lib.create_model(config, (28, 28, 1), 10)
    kernel = model.embed.kernel
    assert kernel.get_metadata("out_sharding") == ("patch", "embed")
    assert kernel.get_metadata("sharding_rules") == tuple(map(tuple, config.mesh.rules))
    parallel.place_module(model, parallel.make_mesh())
    assert kernel[...].sharding.is_fully_replicated  # one device: nothing to split


def test_the_mlp_and_cnn_layers_alternate_split_outputs_and_split_inputs():
    """Megatron's pairs: a layer whose outputs are split (`mlp`) feeds one whose inputs are,
    so no kernel names the `model` axis twice; the classifier's outputs are `classes`."""
    assert model_lib.layer_axes(3) == [("embed", "mlp"), ("mlp", "embed"), ("embed", "classes")]
    cnn = nnx.eval_shape(lambda: model_lib.CNN(rngs=nnx.Rngs(0)))  # no mesh needed
    assert cnn.convs[1].kernel.get_metadata("out_sharding") == (None, None, "mlp", "embed")
    assert cnn.norms[0].scale.get_metadata("out_sharding") == ("mlp",)
    assert cnn.head.kernel.get_metadata("out_sharding") == ("mlp", "classes")


def test_a_plug_in_cannot_replace_a_built_in_model(tmp_path, monkeypatch, registries):
    """A module of config.imports that sets MODELS["mlp"] to its own class is refused in one
    line naming both; registering the same class again, or a new name, is fine."""
    from fmnist_flax import model as model_lib
    from fmnist_flax.runtime import plugins

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "shadowing_plug_in.py").write_text(
        "from fmnist_flax import model\n\n\nclass MLP(model.MLP):\n    pass\n\n\n"
        "model.MODELS['mlp'] = MLP\n"
    )
    with pytest.raises(UserError) as exc:
        plugins.import_modules(("shadowing_plug_in",))
    assert str(exc.value) == (
        "--config.imports: importing 'shadowing_plug_in': model 'mlp' is taken by "
        "fmnist_flax.model.MLP, so shadowing_plug_in.MLP cannot be registered under it; give it "
        "another name"
    )
    assert model_lib.MODELS["mlp"] is model_lib.MLP
    model_lib.MODELS["mlp"] = model_lib.MLP  # the same entry again
    model_lib.MODELS["mlp_in_test"] = model_lib.MLP
