"""Ensembles: `config.ensemble.size` members of one model trained side by side.

The members' arrays (and their optimizers') are stacked on a leading axis and trained with one
`nnx.vmap` of `train.train_step`, inside the same fused chunk as one model, `members_per_pass`
at a time. Each metric has one value per member: metrics.jsonl gets their mean as `name` and
member k's as `name/k`. Everything here is what differs from one model: the rest of the
template sees a model (`Ensemble` gives the ensemble's logits) and a step function.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from .errors import UserError, is_digits

MEMBER_SEPARATOR = "/"  # the column of member k's metric `name` (metrics.jsonl, evaluations)
# On a CPU an ensemble's step runs this many members per device side by side; the members'
# passes run in turn: two members' weights, gradients and Adam moments stay in the CPU's cache
# where eight members' overflow it (docs/performance.md). Accelerators run every member at once.
CPU_MEMBERS_PER_PASS = 2
MAX_MEMBERS = 1024


def stack(objects: Sequence[Any]) -> Any:
    """NNX objects of one structure (members, or their optimizers) as one object whose arrays
    have a leading member axis, in the order given."""
    graphdef = nnx.graphdef(objects[0])
    states = [nnx.state(o) for o in objects]
    return nnx.merge(graphdef, jax.tree.map(lambda *a: jnp.stack(a), *states))


def unstack(obj: Any, k: int) -> Any:
    """Member `k` of a `stack`ed object, as an object of its own."""
    graphdef, state = nnx.split(obj)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[k], state))


def combine(member_logits: jax.Array) -> jax.Array:
    """The ensemble's logits from its members' (leading axis): log of the mean probability."""
    log_probs = jax.nn.log_softmax(member_logits, axis=-1)
    return jax.nn.logsumexp(log_probs, axis=0) - jnp.log(len(member_logits))


class Ensemble(nnx.Module):
    """`size` members of one model, their arrays stacked on a leading axis, run with
    `nnx.vmap`. Called, it gives the ensemble's logits: the log of the members' mean
    probabilities (so its softmax and argmax are the ensemble's)."""

    def __init__(self, members: nnx.Module, size: int):
        self.members = members
        self.size = size
        self.image_shape = getattr(members, "image_shape", None)

    def member_logits(self, x: jax.Array) -> jax.Array:
        """Every member's logits, (size, B, classes), for inference (a vmap over the members'
        state: any trace can call it, e.g. a `jax.export`; BatchNorm statistics and dropout
        streams are read, not advanced: training goes through `train_members`)."""
        graphdef, state = nnx.split(self.members)
        return jax.vmap(lambda s: nnx.merge(graphdef, s)(x))(state)

    def __call__(self, x: jax.Array) -> jax.Array:
        return combine(self.member_logits(x))

    def member(self, k: int) -> nnx.Module:
        """Member `k` as a model of its own."""
        return unstack(self.members, k)


def member_optimizers(
    model: Ensemble, create: Callable[[int], optax.GradientTransformation]
) -> nnx.Optimizer:
    """Each member's own optimizer, `create(k)` (its learning rate and weight decay), stacked."""
    return stack(
        [nnx.Optimizer(model.member(k), create(k), wrt=nnx.Param) for k in range(model.size)]
    )


def from_one_model(source: nnx.Module, model: nnx.Module, init_from: str, workdir: str):
    """What `--init_from` loads into `model`: `source` itself, or for an ensemble `source` as
    every member; an ensemble (from `workdir`) into one model is refused in one line."""
    if isinstance(source, Ensemble) and not isinstance(model, Ensemble):
        raise UserError(
            f"--init_from={init_from}: {workdir} is an ensemble of {source.size}; start "
            f"from one member: --init_from={init_from}@K (or @best)"
        )
    if isinstance(model, Ensemble) and not isinstance(source, Ensemble):
        return Ensemble(stack([source] * model.size), model.size)
    return source


def train_members(
    step: Callable[..., dict[str, jax.Array]],
    model: Ensemble,
    optimizer: nnx.Optimizer,
    x: jax.Array,
    y: jax.Array,
    config: ml_collections.FrozenConfigDict,
    log: bool | jax.Array = True,
) -> dict[str, jax.Array]:
    """`step` (`train.train_step`) for every member at once: one `nnx.vmap` over the stacked
    members and their optimizers. x, y are every member's batch, or one per member (a leading
    member axis) when `config.ensemble.same_data` is False. Each metric has one value per
    member."""
    if config.ensemble.same_data:  # a copy per member: XLA then batches every layer's matmuls
        # (one wide matmul over the shared batch costs a transpose of each weight gradient)
        size = len(jax.tree.leaves(nnx.state(model.members))[0])  # this pass's members
        x, y = (jnp.broadcast_to(a, (size, *a.shape)) for a in (x, y))
    one = functools.partial(step, config=config, log=log)
    return nnx.vmap(one, in_axes=0)(model.members, optimizer, x, y)


def members_per_pass(config: ml_collections.ConfigDict, platform: str) -> int:
    """How many of an ensemble's members one pass of a chunk's steps trains side by side (one
    `nnx.vmap`): `config.ensemble.members_per_pass`, or when 0, every member on an accelerator
    and CPU_MEMBERS_PER_PASS per device (when that divides them) on a CPU."""
    ens = config.ensemble
    if ens.members_per_pass or platform != "cpu":
        return ens.members_per_pass or ens.size
    # A pass of one member is a vmap of one, slower than one model: then all at once.
    per_device = ens.size // ens.shards
    return ens.shards * CPU_MEMBERS_PER_PASS if per_device % CPU_MEMBERS_PER_PASS == 0 else ens.size


def step_for(step: Callable[..., Any], config: ml_collections.ConfigDict) -> Callable[..., Any]:
    """The train step of the config's model: `step` itself, or `train_members` over it."""
    return step if config.ensemble.size == 1 else functools.partial(train_members, step)


def batch_for(
    batch: Callable[..., tuple[jax.Array, jax.Array]],
    order: jax.Array | None,
    aug_key: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """`batch(order, aug_key)`, once per member (a vmap) when the members see their own data
    (`order` has one row per member)."""
    if order is not None and order.ndim == 2:
        return jax.vmap(batch)(order, aug_key)
    return batch(order, aug_key)


def shapes_per_member(fn: Callable[..., Any], model: nnx.Module, *args: Any) -> Any:
    """`jax.eval_shape` of `fn(model, *args)`; for an Ensemble, of every member's (a leading
    member axis)."""
    members = isinstance(model, Ensemble)
    graphdef, state = nnx.split(model.members if members else model)

    def one(state, *args):
        return fn(nnx.merge(graphdef, state), *args)

    each = jax.vmap(one, in_axes=(0, *[None] * len(args))) if members else one
    return jax.eval_shape(each, state, *args)


def in_passes(
    run: Callable[..., tuple[Any, Any, Any]], config: ml_collections.ConfigDict, platform: str
) -> Callable[..., tuple[Any, Any, Any]]:
    """`run(state, sums, order, aug_key)` for the stacked members in groups of
    `members_per_pass`, one group after another (`run` itself when one pass holds them all).
    Member j * passes + p goes in pass p, so a pass takes as many members from each device of
    a `member` mesh axis. The passes are one `fori_loop` with `config.fused_steps`, else
    unrolled (XLA's CPU backend runs convolutions much slower inside a loop body)."""
    passes = config.ensemble.size // members_per_pass(config, platform)
    if passes == 1:
        return run

    def grouped(tree):  # (members, ...) -> (members / passes, passes, ...)
        return jax.tree.map(lambda a: a.reshape(-1, passes, *a.shape[1:]), tree)

    def take(tree, p):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, p, 1, False), tree)

    def all_passes(state, sums, order, aug_key):
        per_member = order is not None and order.ndim == 2
        rows = grouped((order, aug_key)) if per_member else (order, aug_key)

        def run_pass(p, state, sums):
            return run(take(state, p), take(sums, p), *(take(rows, p) if per_member else rows))

        state = grouped(state)
        sums = grouped(sums)
        last = jax.eval_shape(lambda: run_pass(0, state, sums)[2])  # the last step's metrics
        last = jax.tree.map(lambda s: jnp.zeros((s.shape[0], passes, *s.shape[1:]), s.dtype), last)

        def one(p, carry):
            done = run_pass(p, *carry[:2])
            return jax.tree.map(
                lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, p, 1), carry, done
            )

        carry = (state, sums, last)
        if config.fused_steps:
            carry = jax.lax.fori_loop(0, passes, one, carry)
        else:
            for p in range(passes):
                carry = one(p, carry)
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), carry)

    return all_passes


def data_seeds(config: ml_collections.ConfigDict) -> list[int]:
    """The seeds of the data each member sees: [seed], or seed + k for member k when the
    members see their own data (`config.ensemble.same_data` False)."""
    ens = config.ensemble
    if ens.size > 1 and not ens.same_data:
        return [config.seed + k for k in range(ens.size)]
    return [config.seed]


def member_column(name: str, k: int) -> str:
    return f"{name}{MEMBER_SEPARATOR}{k}"


def columns(name: str, value: Any) -> dict[str, float]:
    """A metric as metrics.jsonl columns: `name` alone for one model; for an ensemble's
    members (one value each) their mean as `name` and member k's as `name/k`."""
    value = np.asarray(value, np.float64)
    if value.ndim == 0:
        return {name: float(value)}
    members = {member_column(name, k): float(v) for k, v in enumerate(value)}
    return {name: float(value.mean()), **members}


def member_values(row: dict[str, Any], name: str) -> list[float]:
    """An ensemble's per-member values of metric `name` in a row (`name/0`, `name/1`...), in
    member order; [] for one model."""
    values: list[float] = []
    while member_column(name, len(values)) in row:
        values.append(row[member_column(name, len(values))])
    return values


def best_member(row: dict[str, Any], metric: str = "test_accuracy") -> int | None:
    """The member with the highest `metric` in a row (the first on a tie); None without
    per-member values."""
    values = member_values(row, metric)
    return max(range(len(values)), key=values.__getitem__) if values else None


def member_hyperparams(config: ml_collections.ConfigDict, member: int) -> dict[str, float]:
    """Ensemble member `member`'s learning rate and weight decay: its own where
    `config.ensemble` lists them, config.optimizer's otherwise."""
    ens = config.ensemble
    opt = config.optimizer
    return {
        field: float(ens[field][member] if ens[field] else opt[field])
        for field in ("learning_rate", "weight_decay")
    }


def members_table_rows(
    config: ml_collections.ConfigDict, full: dict[str, Any], last: dict[str, Any], count: str
) -> list[dict[str, Any]]:
    """Each member's seed, learning rate, weight decay, final training row (`last`) and test
    metrics (`full`, without its `count` field); empty for one model."""
    if config.ensemble.size == 1:
        return []
    names = [n for n in full if MEMBER_SEPARATOR not in n and n != count]
    trained = [
        n for n in last if MEMBER_SEPARATOR not in n and n != "step" and not n.startswith("test_")
    ]
    return [
        {
            "member": k,
            "seed": config.seed + k,
            **member_hyperparams(config, k),
            **{
                f"final_train_{n}": last[member_column(n, k)]
                for n in trained
                if member_column(n, k) in last
            },
            **{f"test_{n}": full[member_column(n, k)] for n in names},
        }
        for k in range(config.ensemble.size)
    ]


ENSEMBLE = "ensemble"  # --member: the ensemble itself (its members' mean probabilities)
BEST_MEMBER = "best"  # --member: the member with the best test accuracy at that step


def parse_member(value: str | None) -> int | str | None:
    """--member: a member number, `best`, `ensemble`, or unset (the ensemble, for an ensemble
    run)."""
    if value is None or value in (BEST_MEMBER, ENSEMBLE):
        return value
    if not is_digits(value):
        raise UserError(f"--member={value} must be a member number, 'best' or 'ensemble'")
    return int(value)


def select_member(restored: tuple, member: int | str | None, checkpoints, flag: str) -> tuple:
    """`restore_model`'s result with its model replaced by what `member` picks of an ensemble:
    member K, the best member by its test accuracy at that step, or the ensemble (default)."""
    model, step, config, info = restored
    where = f"{flag} {checkpoints.directory.parent}"
    if not isinstance(model, Ensemble):
        if member is None:
            return restored
        raise UserError(f"--member={member}: {where} trained one model, not an ensemble")
    if member in (None, ENSEMBLE):
        return model, step, config, {**info, "member": ENSEMBLE}
    if member == BEST_MEMBER:
        member = best_member(checkpoints.saved("progress", step)[1] or {})
        if member is None:
            raise UserError(
                f"--member=best: checkpoint {step} in {where} was not evaluated, so no member "
                "is known best; pass --member=K, or a --step that was evaluated"
            )
    if not 0 <= member < model.size:
        raise UserError(f"--member={member}: {where} has members 0..{model.size - 1}")
    return model.member(member), step, config, {**info, "member": member}


def check_config(config: ml_collections.ConfigDict, max_seed: int) -> None:
    """`config.ensemble`: a size, per-member values of that length, a data rule that the input
    pipeline can follow; members' seeds run from `config.seed` and stay <= `max_seed`."""
    ens = config.ensemble
    flag = "--config.ensemble"
    if isinstance(ens.size, bool) or not isinstance(ens.size, int) or ens.size < 1:
        raise UserError(f"{flag}.size={ens.size!r} must be a whole number of members >= 1")
    if (
        isinstance(ens.shards, bool)
        or not isinstance(ens.shards, int)
        or ens.shards < 1
        or (ens.size % ens.shards)
    ):
        raise UserError(
            f"{flag}.shards={ens.shards!r} must be a whole number >= 1 that divides "
            f"{flag}.size={ens.size} (the members are split over that many devices)"
        )
    per_pass = ens.members_per_pass
    if (
        isinstance(per_pass, bool)
        or not isinstance(per_pass, int)
        or per_pass < 0
        or (per_pass and (ens.size % per_pass or per_pass % ens.shards))
    ):
        raise UserError(
            f"{flag}.members_per_pass={per_pass!r} must be 0 (chosen for the device) or a whole "
            f"number that divides {flag}.size={ens.size} and is a multiple of "
            f"{flag}.shards={ens.shards}"
        )
    if ens.size > MAX_MEMBERS or config.seed + ens.size - 1 > max_seed:
        raise UserError(
            f"{flag}.size={ens.size} is too large: at most {MAX_MEMBERS} members, and "
            f"--seed + size - 1 must stay <= {max_seed:,}"
        )
    for field, low in (("learning_rate", 0.0), ("weight_decay", 0.0)):
        values = ens[field]
        if not isinstance(values, tuple | list) or len(values) not in (0, ens.size):
            raise UserError(
                f"{flag}.{field}={values!r} must be a tuple of {ens.size} values, one per member "
                f"(--config.ensemble.size={ens.size}), or () for config.optimizer's"
            )
        for value in values:
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if (
                not number
                or not low <= value < math.inf
                or (field == "learning_rate" and not value)
            ):
                bound = "positive" if field == "learning_rate" else ">= 0"
                raise UserError(f"{flag}.{field}: {value!r} must be a finite number {bound}")
    if ens.learning_rate and config.optimizer.schedule != "constant":
        raise UserError(
            f"{flag}.learning_rate sets per-member rates, which need "
            "--config.optimizer.schedule=constant (a schedule's peak is config.optimizer's)"
        )
    if ens.size > 1 and not ens.same_data and config.input_pipeline == "grain":
        raise UserError(
            f"{flag}.same_data=False gives each member its own batches, which only "
            "--config.input_pipeline=device can gather; use it, or same_data=True"
        )


def default_config() -> ml_collections.ConfigDict:
    """Several members of the model trained at once, as one program (`nnx.vmap` over the
    stacked members and their optimizers); member k is initialised from seed + k."""
    ensemble = ml_collections.ConfigDict()
    ensemble.size = 1  # 1: a single model, no member axis
    # Per-member values, a tuple of `size` (empty: every member uses config.optimizer's).
    ensemble.learning_rate = ()
    ensemble.weight_decay = ()
    # True: every member sees the same batches; False: member k the data order (and
    # augmentation) of a single run with --seed=seed+k.
    ensemble.same_data = True
    # Split the members over this many devices (a `member` mesh axis; the devices of each
    # part split every batch over `data`). It must divide `size` and the device count. On a
    # CPU, main.py makes the devices: set it to the number of cores (faster than one device).
    ensemble.shards = 1
    # Members trained side by side (one vmap) in each pass over a chunk's steps; the passes run
    # in turn. A multiple of `shards` that divides `size`; 0: every member on a GPU or TPU, 2 per
    # device on a CPU, whose cache eight members' optimizer state overflows. The rounding of
    # a member's batched arithmetic may differ with it in the last bit.
    ensemble.members_per_pass = 0
    return ensemble
