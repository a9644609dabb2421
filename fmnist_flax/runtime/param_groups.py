"""Parameter groups by name: a parameter's tree path as `layers/0/kernel`, the kernels mask
weight decay uses, and per-group multipliers of the updates (`lr_multipliers`), each pattern
checked in one line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import optax

from .errors import UserError


def parameter_name(path: Sequence[Any]) -> str:
    """A parameter's tree path as `layers/0/kernel` (an nnx Variable's `.value` left out): what
    `lr_multipliers` patterns and decay masks see."""
    return "/".join(
        str(getattr(key, "key", getattr(key, "idx", "")))
        for key in path
        if not isinstance(key, jax.tree_util.GetAttrKey)
    )


def kernels(params: Any) -> Any:
    """True for each kernel (a dense or convolution layer's weights), False for biases,
    normalisation scales and the rest, as big_vision and MaxText decay them."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: parameter_name(path).rsplit("/", 1)[-1] == "kernel", params
    )


def scale_groups(multipliers: Sequence[Sequence[Any]]) -> optax.GradientTransformation:
    """Each parameter's update times the multiplier of the first (pattern, multiplier) whose
    pattern `re.search` finds in its name (1 when none does). A pattern matching no parameter
    is refused when the optimizer is made."""
    compiled = [(re.compile(pattern), multiplier) for pattern, multiplier in multipliers]

    def factor(path: Sequence[Any]) -> float:
        name = parameter_name(path)
        return next((m for pattern, m in compiled if pattern.search(name)), 1.0)

    def init(params: Any) -> optax.EmptyState:
        names = [parameter_name(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
        for pattern, _ in compiled:
            if not any(pattern.search(name) for name in names):
                raise UserError(
                    f"--config.optimizer.lr_multipliers: {pattern.pattern!r} matches no "
                    f"parameter; their names are {', '.join(names)}"
                )
        return optax.EmptyState()

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, Any]:
        del params
        scaled = jax.tree_util.tree_map_with_path(lambda path, u: u * factor(path), updates)
        return scaled, state

    return optax.GradientTransformation(init, update)


def check_multipliers(value: Any) -> None:
    """`lr_multipliers`: (pattern, multiplier) pairs, each pattern a regular expression."""
    flag = f"--config.optimizer.lr_multipliers={value!r}"
    pairs = value if isinstance(value, tuple | list) else None
    if pairs is None or not all(isinstance(p, tuple | list) and len(p) == 2 for p in pairs):
        raise UserError(
            f"{flag} must be (pattern, multiplier) pairs, e.g. '((\"head\", 0.1),)': the first "
            "pattern found in a parameter's name (layers/0/kernel) gives its multiplier"
        )
    for pattern, multiplier in pairs:
        if not isinstance(pattern, str):
            raise UserError(f"{flag}: the pattern {pattern!r} must be a string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise UserError(f"{flag}: {pattern!r} is not a regular expression ({exc})") from None
        number = isinstance(multiplier, int | float) and not isinstance(multiplier, bool)
        if not number or not 0 <= multiplier < math.inf:
            raise UserError(f"{flag}: the multiplier of {pattern!r} must be a number >= 0")
