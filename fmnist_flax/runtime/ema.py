"""An exponential moving average (EMA) of the parameters, kept inside the model.

With `config.ema.decay` > 0 each `nnx.Param` gets a twin `EMA` variable of its shape beside it
(`kernel` -> `kernel_ema`), with its metadata, so whatever handles the model's state carries the
average with no code of its own: the mesh's shardings (by shape and axis names, laid out like
its parameter), checkpoints, resumes, an ensemble's stacked members. `update`, run by
`train.train_step` after each optimizer update, moves each twin toward its parameter;
`averaged(model)` is the model with the averages as its parameters, to evaluate, predict or
export. BatchNorm statistics (`nnx.BatchStat`) are not averaged: an
averaged model normalises with the trained model's running statistics.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
from flax import nnx

from .errors import UserError

SUFFIX = "_ema"  # a parameter `kernel`'s twin is the attribute `kernel_ema` beside it
TEST_PREFIX = "test_ema_"  # the averaged model's test metrics: test_ema_loss, ...


class EMA(nnx.Variable):
    """The moving average of the `nnx.Param` beside it: no gradient, no optimizer state."""


def attach(model: nnx.Module, decay: float) -> None:
    """Give each parameter of `model` its EMA twin, equal to it (nothing when `decay` is 0)."""
    if not decay:
        return
    nodes = dict(nnx.iter_graph(model))
    for path, node in nodes.items():
        if isinstance(node, nnx.Param):
            parent = nodes[path[:-1]]
            if not isinstance(parent, nnx.Module) or isinstance(parent, nnx.List | nnx.Dict):
                name = ".".join(map(str, path))
                raise UserError(
                    f"--config.ema.decay={decay}: parameter {name} is an item of a "
                    f"{type(parent).__name__}, not a module's attribute, so it has no place "
                    "for its average; hold it in a module, or train with decay 0"
                )
            # Its metadata too: annotated axis names lay the twin out like its parameter.
            twin = EMA(jnp.copy(node[...]), **node.get_metadata())
            setattr(parent, f"{path[-1]}{SUFFIX}", twin)


def _param_path(twin_path: tuple) -> tuple:
    return (*twin_path[:-1], twin_path[-1].removesuffix(SUFFIX))


def _pairs(model: nnx.Module) -> list[tuple[nnx.Variable, EMA]]:
    """(parameter, its twin) for every twin in `model`: the model's own Variables."""
    variables = dict(nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, EMA))))
    return [
        (variables[_param_path(path)], twin)
        for path, twin in variables.items()
        if isinstance(twin, EMA)
    ]


def kept(model: nnx.Module) -> bool:
    """Whether `model` holds an EMA of its parameters."""
    return bool(_pairs(model))


def update(model: nnx.Module, optimizer: nnx.Optimizer, config: ml_collections.ConfigDict) -> None:
    """After update t (the optimizer's count), move each twin toward its parameter by the
    debiased weight (1 - d) / (1 - d**t): update 1 copies the parameters and the twin is
    then the mean of the updates' parameters weighted d**age (optax.ema(debias=True)'s)."""
    decay = config.ema.decay
    if not decay:
        return
    d = jnp.float32(decay)
    weight = (1 - d) / (1 - d ** optimizer.step[...].astype(jnp.float32))
    for param, twin in _pairs(model):
        twin[...] = twin[...] + weight * (param[...] - twin[...])


def averaged(model: nnx.Module) -> nnx.Module:
    """A model like `model` whose parameters are their twins' averages; `model` is untouched."""
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))
    for path, twin in list(flat.items()):
        if isinstance(twin, EMA):
            flat[_param_path(path)] = flat[_param_path(path)].replace(twin[...])
    return nnx.merge(graphdef, nnx.from_flat_state(flat), copy=True)
