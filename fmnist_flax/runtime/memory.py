"""What the machine can hold: a run whose models or Grain blocks cannot fit is refused in one
line naming the field, before they are built. Host memory is the least of /proc/meminfo's
MemAvailable, every enclosing cgroup's limit less its use, `ulimit -d` and `ulimit -v`; a
device's is its `memory_stats`. A model's size is sized from abstract shapes (`member_bytes`),
with the template's model, optimizer and evaluation call handed in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import resource
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from . import ema, ensemble, grain_pipeline, parallel, registry
from .errors import UserError

if TYPE_CHECKING:  # data_files imports inference, which sizes predict's images here
    from .data_files import Dataset

# The model's bytes: (config, image_shape, num_classes, saved_copy) -> bytes each model holds.
MemberBytes = Callable[[ml_collections.ConfigDict, tuple[int, int, int], int, bool], int]
# (config, image shape, classes, batch, bytes usable) -> what one training step holds besides
# the model's state, for one model and `batch` examples.
StepBytes = Callable[[ml_collections.ConfigDict, tuple[int, int, int], int, int, int], int]


LABEL_BYTES = 4  # int32 labels
INDEX_BYTES = 8  # a Grain block's examples are picked by int64 indices (read_block)
BLOCKS_PLACED = 2  # GrainBatches keeps the block being trained and the next on the devices
# What the estimates leave out: compiling, the runtime's threads and buffers (RUN_RESERVE), the
# allocators' slack and what other processes take meanwhile (all but USABLE of what is free).
RUN_RESERVE = 256 * 2**20
USABLE = 0.9


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes that can still be allocated, and where that figure was read."""

    free: int
    source: str

    def __str__(self) -> str:
        return f"{size_text(self.free)} available ({self.source})"

    def usable(self, held: int = 0) -> int:
        """What a run may plan to use of it, besides `held` bytes already planned."""
        return int(self.free * USABLE) - RUN_RESERVE - held


def size_text(size: float) -> str:
    """Bytes for a person: 26.3 MiB, 21.78 GiB, 1,592.00 GiB."""
    if abs(size) < 2**30:
        return f"{size / 2**20:,.1f} MiB"
    return f"{size / 2**30:,.2f} GiB"


def check_threads(config: ml_collections.ConfigDict) -> None:
    """Refuse more Grain read threads than usable cores: Grain buffers at least a block per
    thread, so threads the cores cannot run hold more memory without reading faster."""
    workers = config.grain.workers
    cores = grain_pipeline.usable_cores()
    if config.input_pipeline == "grain" and workers > cores:
        raise UserError(
            f"--config.grain.workers={workers} is more read threads than the {cores} cores this "
            "process may use: each thread buffers a block of examples, so threads beyond the "
            f"cores only hold more memory; use at most {cores}, or 0 (one per core, at most "
            f"{grain_pipeline.MAX_WORKERS})"
        )


def _meminfo(proc: pathlib.Path) -> list[Memory]:
    """MemAvailable: what the kernel can hand out without swapping."""
    with contextlib.suppress(OSError):
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return [Memory(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")]
    return []


def _cgroup_left(proc: pathlib.Path, cgroups: pathlib.Path) -> list[Memory]:
    """Each enclosing cgroup's memory limit less its usage (v1 and v2), from this process's
    own cgroup up to its hierarchy's root: a limit holds for everything below it."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    left = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if not controllers:
            root, limit_file, usage_file = cgroups, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            root = cgroups / "memory"
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        directory = root / path.lstrip("/")
        while True:
            with contextlib.suppress(OSError, ValueError):  # absent, or "max": no limit
                limit = int((directory / limit_file).read_text())
                usage = int((directory / usage_file).read_text())
                name = "/" + str(directory.relative_to(root)).removeprefix(".")
                left.append(Memory(limit - usage, f"the memory limit of cgroup {name} less use"))
            if directory == root or root not in directory.parents:
                break
            directory = directory.parent
    return left


# The process limits a run's allocations count against: each with the /proc/self/status field
# it is held to, and how a person sets it.
PROCESS_LIMITS = (
    (resource.RLIMIT_DATA, "VmData", "ulimit -d"),  # data: heap and anonymous mappings
    (resource.RLIMIT_AS, "VmSize", "ulimit -v"),  # the whole address space
)


def _process_limits_left(proc: pathlib.Path) -> list[Memory]:
    """Each of `PROCESS_LIMITS` that is set, less what this process holds against it:
    `ulimit -d` (RLIMIT_DATA) less VmData, `ulimit -v` (RLIMIT_AS) less VmSize."""
    try:
        status = (proc / "self" / "status").read_text()
    except OSError:
        return []
    left = []
    for limit, field, name in PROCESS_LIMITS:
        soft = resource.getrlimit(limit)[0]
        if soft == resource.RLIM_INFINITY:
            continue
        with contextlib.suppress(IndexError, ValueError):
            held = int(status.split(f"{field}:")[1].split()[0]) * 1024
            source = f"{name} of {size_text(soft)} less {size_text(held)} in use"
            left.append(Memory(soft - held, source))
    return left


def host_memory(
    proc: pathlib.Path = pathlib.Path("/proc"),
    cgroups: pathlib.Path = pathlib.Path("/sys/fs/cgroup"),
) -> Memory | None:
    """What this process may still allocate on the host: the least of /proc/meminfo's
    MemAvailable, each enclosing cgroup's limit less its usage, `ulimit -d` less the data held
    and `ulimit -v` less the address space held; None where the OS tells none of them."""
    found = [*_meminfo(proc), *_cgroup_left(proc, cgroups), *_process_limits_left(proc)]
    return min(found, key=lambda m: m.free) if found else None


def device_memory(devices: list[jax.Device]) -> Memory | None:
    """The least any of `devices` may still allocate (its `memory_stats`: bytes_limit less
    bytes_in_use); None where they keep no such statistics (a CPU)."""
    free = []
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            left = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            free.append(Memory(left, f"{device}: memory_stats' bytes_limit less bytes_in_use"))
    return min(free, key=lambda m: m.free) if free else None


def tree_bytes(tree: Any) -> int:
    """The bytes of every array (or abstract shape) in `tree`."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


PROBE_MEMBERS = 8  # members an evaluation call is compiled for to size one member's share

# Sizes worked out by tracing, kept for later runs of this process with the same config, data
# shapes, functions and registered entries (a sweep or a test suite runs many).
_SIZES: dict[tuple, tuple[int, list]] = {}


def _remembered(config: ml_collections.ConfigDict, key: tuple, size: Callable[[], int]) -> int:
    """`size()`, or what it gave before for `key` with this config and the same registered
    entries seen by its run (a config that cannot be hashed: worked out each time)."""
    entries = registry.seen_by(config.imports)
    key = (ml_collections.FrozenConfigDict(config), *key, *(id(e) for *_, e in entries))
    try:
        hash(key)
    except TypeError:
        return size()
    if key not in _SIZES:
        if len(_SIZES) >= 64:
            _SIZES.clear()
        _SIZES[key] = size(), entries  # the entries kept alive: their ids stay theirs
    return _SIZES[key][0]


def abstract_state(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
    *,
    abstract_model: Callable[..., nnx.Module],
    make_tx: Callable[[ml_collections.ConfigDict], Any],
) -> tuple[nnx.Module, nnx.Optimizer]:
    """One model of the config (`abstract_model`, with its EMA's twins) and its optimizer
    (`make_tx(config)`) as shapes and dtypes only (nothing allocated): what the update hooks a
    step runs will find."""
    model = abstract_model(config, image_shape, num_classes)
    if config.ema.decay:
        model = nnx.eval_shape(lambda m: (ema.attach(m, config.ema.decay), m)[1], model)
    optimizer = nnx.eval_shape(lambda m: nnx.Optimizer(m, make_tx(config), wrt=nnx.Param), model)
    return model, optimizer


def member_bytes(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
    saved_copy: bool = True,
    *,
    abstract_state: Callable[..., tuple[nnx.Module, nnx.Optimizer]],
    evaluate_batches: Callable[..., Any],
    examples_per_call: int,
) -> int:
    """What each model of a run holds, sized from `abstract_state` (nothing allocated): its
    state, its parameters' gradients and its optimizer's state, with `saved_copy` the host
    copy of state and optimizer a checkpoint writes while training goes on (in the same memory
    on a CPU); for an ensemble also a member's share of an evaluation call
    (`evaluate_batches` over `examples_per_call`), which runs every member at once."""
    args = (
        image_shape,
        num_classes,
        saved_copy,
        abstract_state,
        evaluate_batches,
        examples_per_call,
    )
    return _remembered(config, ("members", *args), lambda: _member_bytes(config, *args))


def _member_bytes(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
    saved_copy: bool,
    abstract_state: Callable[..., tuple[nnx.Module, nnx.Optimizer]],
    evaluate_batches: Callable[..., Any],
    examples_per_call: int,
) -> int:
    model, optimizer = abstract_state(config, image_shape, num_classes)
    state = tree_bytes(nnx.state(model)) + tree_bytes(nnx.state(optimizer, nnx.OptState))
    held = state * (1 + saved_copy) + tree_bytes(nnx.state(model, nnx.Param))
    if config.ensemble.size > 1:
        held += evaluation_bytes_per_member(
            config, model, image_shape, evaluate_batches, examples_per_call
        )
    return held


def evaluation_bytes_per_member(
    config: ml_collections.ConfigDict,
    model: nnx.Module,
    image_shape: tuple[int, int, int],
    evaluate_batches: Callable[..., Any],
    examples_per_call: int,
) -> int:
    """One member's share of an ensemble's evaluation call: XLA's memory analysis of
    `evaluate_batches` compiled (not run) for up to PROBE_MEMBERS abstract members of `model`
    and the most batches one call holds; 0 where the backend gives no analysis."""
    size = min(config.ensemble.size, PROBE_MEMBERS)
    members = nnx.eval_shape(lambda m: ensemble.Ensemble(ensemble.stack([m] * size), size), model)
    members.eval()
    graphdef, state = nnx.split(members)
    # uint8 images, labels and a mask, for the most batches one call holds.
    shape = (max(1, examples_per_call // config.batch_size), config.batch_size)
    frozen = ml_collections.FrozenConfigDict(config)

    def call(state, images, labels, mask):
        return evaluate_batches(nnx.merge(graphdef, state), images, labels, mask, frozen)

    inputs = [
        jax.ShapeDtypeStruct((*shape, *image_shape), jnp.uint8),
        jax.ShapeDtypeStruct(shape, jnp.int32),
        jax.ShapeDtypeStruct(shape, jnp.float32),
    ]
    analysis = jax.jit(call).lower(state, *inputs).compile().memory_analysis()
    return analysis.temp_size_in_bytes // size if analysis else 0


def grain_blocks(
    config: ml_collections.ConfigDict, image_shape: tuple[int, int, int]
) -> tuple[int, int, int]:
    """(blocks in memory at once, steps a block, bytes a block) of the Grain pipeline: Grain's
    buffer (`prefetch`, at least a block per read thread) and the blocks on the devices; a
    block holds this process's share of its pixels and labels, and the indices picking them."""
    threads = grain_pipeline.read_threads(config.grain.workers)
    steps = grain_pipeline.block_steps(config)
    examples = steps * config.optimizer.accumulate * config.batch_size
    share = examples // jax.process_count() * (math.prod(image_shape) + LABEL_BYTES)
    return (
        max(config.grain.prefetch, threads) + BLOCKS_PLACED,
        steps,
        share + examples * INDEX_BYTES,
    )


def check_memory(
    config: ml_collections.ConfigDict,
    dataset: Dataset,
    mesh: jax.sharding.Mesh,
    member_bytes: MemberBytes,
    step_bytes: StepBytes,
) -> None:
    """Refuse, in one line, a run whose models, training step or Grain blocks cannot fit in what
    is left once the data is loaded and placed: the models and the step's activations in the
    devices' memory (a CPU's is the host's), the blocks in the host's, each within
    `Memory.usable`."""
    devices = list(mesh.devices.flat)
    on_host = devices[0].platform == "cpu"
    host = host_memory()
    memory = host if on_host else device_memory(devices)
    held = check_models(
        config, dataset.image_shape, dataset.num_classes, memory, on_host, member_bytes
    )
    held += check_step(config, dataset, mesh, memory, held, step_bytes)
    if config.input_pipeline == "grain" and host is not None:
        check_grain(config, dataset.image_shape, host, held if on_host else 0)


def check_models(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
    memory: Memory | None,
    on_host: bool,
    member_bytes: MemberBytes,
) -> int:
    """The bytes the run's models hold on each device (`member_bytes` each; an ensemble's
    members split over `shards` devices, but on a CPU all in the host's memory); refused in
    one line naming the field where `memory.usable()` cannot hold them."""
    members = config.ensemble.size
    try:
        each = member_bytes(config, image_shape, num_classes, on_host)
    except (TypeError, ValueError):  # a model that cannot be built: create_model says why
        return 0
    shards = 1 if on_host else config.ensemble.shards
    held = members // shards * each
    if memory is None or held <= memory.usable():
        return held
    parts = "parameters, gradients, optimizer state" + (
        ", the copy a checkpoint writes" if on_host else ""
    )
    where = _where(memory, on_host)
    if members == 1:
        raise UserError(
            f"--config.model: the model needs about {size_text(held)} ({parts}) on {where}; "
            "choose a smaller model"
        )
    fit = memory.usable() // each * shards
    raise UserError(
        f"--config.ensemble.size={members}: {members:,} members need about {size_text(held)} "
        f"({size_text(each)} each: {parts}, a share of an evaluation call) on {where}; "
        + (f"use at most about {fit:,} members" if fit > 1 else "choose a smaller model")
    )


def _where(memory: Memory, on_host: bool) -> str:
    """Where a run's memory is planned, for a refusal: 'the host, which has ...'."""
    return (
        f"{'the host' if on_host else 'each device'}, which has {memory}, of which a run may "
        f"plan {size_text(memory.usable())}"
    )


def check_step(
    config: ml_collections.ConfigDict,
    dataset: Dataset,
    mesh: jax.sharding.Mesh,
    memory: Memory | None,
    held: int,
    step_bytes: StepBytes,
) -> int:
    """The bytes the training step holds at once on each device (`step_bytes` for a device's
    share of the batch, times the members a pass trains there together; on a CPU the whole
    batch and pass in the host's memory); refused in one line naming --batch_size where they
    do not fit in `memory.usable` besides the `held` bytes of the models."""
    if memory is None:
        return 0
    platform = mesh.devices.flat[0].platform
    on_host = platform == "cpu"
    batch = config.batch_size if on_host else max(1, config.batch_size // parallel.data_size(mesh))
    together = ensemble.members_per_pass(config, platform)
    together = together if on_host else max(1, together // config.ensemble.shards)
    usable = memory.usable(held)
    try:
        each = step_bytes(
            config, dataset.image_shape, dataset.num_classes, batch, usable // together
        )
    except (TypeError, ValueError):  # a model that cannot be built: create_model says why
        return 0
    needed = each * together
    if needed <= usable:
        return needed
    fit = config.batch_size * max(usable, 0) // needed  # activations grow with the batch
    raise UserError(
        f"--batch_size={config.batch_size}: a training step needs about {size_text(needed)} "
        f"(its batch, activations and temporaries, by XLA's memory analysis) besides "
        f"{size_text(held)} for the model{'s' if config.ensemble.size > 1 else ''}, on "
        f"{_where(memory, on_host)}; "
        + (f"use at most about --batch_size={fit:,}" if fit > 0 else "choose a smaller model")
    )


def step_bytes(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
    batch: int,
    usable: int,
    *,
    train_step: Callable[..., Any],
    abstract_state: Callable[..., tuple[nnx.Module, nnx.Optimizer]],
) -> int:
    """What one `train_step` of one model holds besides its state, for `batch` examples (a
    micro-batch each of `optimizer.accumulate`): its float32 batch, activations and
    temporaries. Every value the step's program computes, summed, when that is within `usable`
    (a generous bound: far fewer are alive at once); else XLA's memory analysis of the step
    compiled, not run, for abstract arrays (no analysis: the batch alone). `abstract_state`:
    (config, image_shape, num_classes) -> the model and optimizer as shapes. The bound is
    traced once per config in a process."""
    frozen = ml_collections.FrozenConfigDict(config)
    accumulate = config.optimizer.accumulate
    lead = (accumulate, batch) if accumulate > 1 else (batch,)
    inputs = (
        jax.ShapeDtypeStruct((*lead, *image_shape), jnp.float32),
        jax.ShapeDtypeStruct(lead, jnp.int32),
    )
    held = tree_bytes(inputs)

    def abstract_step() -> tuple[Callable[..., Any], Any]:
        graphdef, state = nnx.split(abstract_state(config, image_shape, num_classes))

        def step(state, x, y):
            model, optimizer = nnx.merge(graphdef, state)
            metrics = train_step(model, optimizer, x, y, frozen)
            return metrics, nnx.state((model, optimizer))

        return step, state

    def bound() -> int:
        step, state = abstract_step()
        return held + values_bytes(jax.make_jaxpr(step)(state, *inputs).jaxpr)

    key = ("step", image_shape, num_classes, batch, train_step, abstract_state)
    if (generous := _remembered(config, key, bound)) <= usable:
        return generous
    step, state = abstract_step()
    analysis = jax.jit(step, donate_argnums=0).lower(state, *inputs).compile().memory_analysis()
    return held + (analysis.temp_size_in_bytes if analysis else 0)


def values_bytes(jaxpr: Any) -> int:
    """The bytes of every value `jaxpr` computes, its inner programs' (loop bodies, branches)
    counted once each: a generous bound on what a program holds at once."""
    total = 0
    for eqn in jaxpr.eqns:
        for value in eqn.outvars:
            aval = value.aval
            if hasattr(aval, "shape") and isinstance(aval.dtype, np.dtype):  # not a key or token
                total += math.prod(aval.shape) * aval.dtype.itemsize
        total += sum(values_bytes(inner) for inner in jax_core.jaxprs_in_params(eqn.params))
    return total


def check_grain(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    host: Memory,
    held: int,
) -> None:
    """Refuse, in one line naming the fields, Grain blocks in flight (`grain_blocks`) that do
    not fit in what the host can use besides the `held` bytes of the models."""
    blocks, steps, block = grain_blocks(config, image_shape)
    if blocks * block <= host.usable(held):
        return
    grain = config.grain
    raise UserError(
        f"--config.grain.block_examples={grain.block_examples} with --config.grain.prefetch="
        f"{grain.prefetch} and --config.grain.workers={grain.workers} keeps {blocks:,} blocks "
        f"of {steps:,} steps in memory, about {size_text(blocks * block)} ({size_text(block)} "
        f"a block), but the host has {host}"
        + f", of which a run may plan {size_text(host.usable())}"
        + "; lower block_examples or prefetch"
    )
