"""A model built from a registry of classes (`config.model.name` -> class): its fields checked
against the constructor (and the class's own `check_config`), its parameters initialised by one
compiled program, an ensemble's members stacked, or only its shapes for sizing a run.

A model class takes its config fields, then keyword-only `image_shape`, `num_classes`,
`compute_dtype` and `rngs`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from . import errors, parallel
from .ensemble import Ensemble, stack
from .errors import UserError
from .registry import Registry


def check_config(
    models: Registry,
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    built_in_args: tuple[str, ...],
) -> None:
    """Refuse a model name the run does not see (`models.active(config.imports)`), a field its
    constructor does not take, or (through the model's own `check_config`) a value it cannot
    use: one line each, before anything builds. `built_in_args`: the constructor's arguments
    that are not config fields."""
    fields = config.model.to_dict()
    name = fields.pop("name", "mlp")
    imports = config.get("imports", ())
    if name not in models.active(imports):
        raise UserError(f"--config.model.name={name!r} {models.absent(name, imports)}")
    cls = models.active(imports)[name]
    parameters = inspect.signature(cls.__init__).parameters
    takes = [p for p in parameters if p not in ("self", *built_in_args)]
    for field in fields:
        if field not in takes:
            raise UserError(
                f"--config.model.{field}: model {name!r} takes no field {field!r}; its fields "
                f"are {', '.join(takes) or 'none'}"
            )
    if hasattr(cls, "check_config"):
        cls.check_config(fields, tuple(image_shape))


def create_model(
    static: tuple, config: ml_collections.ConfigDict, seed: int | None = None
) -> nnx.Module:
    """Build the model of `static` (`static_args`, once `check_config` accepts the config), or
    `config.ensemble.size` of them stacked, initialised from `seed` (default: `config.seed`).
    Its arrays are not yet laid out on a mesh (annotated ones included:
    `parallel.place_module` does that, by `config.mesh.rules`).

    The initialisation is compiled as one program: eagerly, each random op would compile on
    its own, which costs over a second at start-up.
    """
    seed = config.seed if seed is None else seed
    size = config.ensemble.size
    try:
        if size == 1:
            return _build(*static, np.uint32(seed))  # a NumPy scalar: no eager conversion
        members = [_build(*static, np.uint32(seed + k)) for k in range(size)]
        return Ensemble(stack(members), size)
    except (TypeError, ValueError) as exc:  # a model without its own check_config
        message = errors.reason(exc)
        raise UserError(
            f"model {config.model.get('name', 'mlp')!r} cannot be built from --config.model: "
            f"{message}"
        ) from None


def static_args(
    models: Mapping[str, type],
    compute_dtypes: Mapping[str, Any],
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
) -> tuple[type, tuple, tuple, Any, tuple]:
    """What the init program is compiled for (hashable): the model's class, its fields, the
    data's shape and classes, the compute dtype, the logical axis rules."""
    fields = config.model.to_dict()
    cls = models[fields.pop("name", "mlp")]
    kwargs = tuple((k, tuple(v) if isinstance(v, list | tuple) else v) for k, v in fields.items())
    rules = parallel.check_rules(config.mesh.rules)
    shape = (tuple(image_shape), int(num_classes))
    return cls, kwargs, shape, compute_dtypes[config.compute_dtype], rules


# The initialisation runs once, so LLVM's lighter optimisation is enough: its compile takes
# about half the time, with the same values to the bit (a test checks).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def _construct(
    cls: type, kwargs: tuple, shape: tuple, compute_dtype: Any, rules: tuple, seed: jax.Array
) -> nnx.Module:
    """The model, its annotated Variables unplaced (no mesh is needed to build one: Flax's
    eager sharding is off) and carrying `rules` as their `sharding_rules`, which
    `parallel.place` reads."""
    key = jax.random.key(seed)
    rngs = nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1))
    image_shape, num_classes = shape
    with nnx.use_eager_sharding(False):
        model = cls(
            **dict(kwargs),
            image_shape=image_shape,
            num_classes=num_classes,
            compute_dtype=compute_dtype,
            rngs=rngs,
        )
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and node.get_metadata("out_sharding", None):
            node.set_metadata("sharding_rules", rules)
    return model


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), compiler_options=INIT_COMPILER_OPTIONS)
def _initial_state(*args) -> nnx.State:
    return nnx.state(_construct(*args))


def _build(*args) -> nnx.Module:
    """The model `_construct(*args)` makes, its arrays computed by one compiled program."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: _construct(*args)))
    return nnx.merge(graphdef, _initial_state(*args))


def abstract_model(static: tuple) -> nnx.Module:
    """One model of `static` (`static_args`) as shapes and dtypes only (`nnx.eval_shape`):
    what it would hold, with nothing allocated, for sizing a run."""
    return nnx.eval_shape(lambda: _construct(*static, jnp.uint32(0)))
