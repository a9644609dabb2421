"""Devices and processes: `jax.distributed`, the mesh, and where every array lives.

One program runs in every process (JAX's multi-controller SPMD). Batches are split along the
mesh's `data` axis. Parameters annotated with logical axis names (`nnx.with_partitioning`) are
split as `config.mesh.rules` maps those names to mesh axes (e.g. `mlp` -> `model`, a
`config.mesh.model`-sized axis); the rest is replicated, or sharded along `data` (FSDP) with
`param_sharding="fsdp"`. XLA inserts the collectives (gradient all-reduce, parameter
all-gathers), so the compiled steps are the same code for 1 device and for N.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import compilation_cache, errors
from .errors import UserError, error_line

DATA_AXIS = "data"
MEMBER_AXIS = "member"  # an ensemble's members split over devices (config.ensemble.shards)
MODEL_AXIS = "model"  # annotated parameters split over devices (config.mesh.model)
MESH_AXES = (MEMBER_AXIS, DATA_AXIS, MODEL_AXIS)  # the order of a mesh's axes
PARAM_SHARDINGS = ("replicated", "fsdp")
CONNECT_RETRY_S = 0.5
# JAX's own deadline fires this much after ours; its failure is a C++ abort with a stack dump.
JAX_TIMEOUT_MARGIN_S = 30


def initialize(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    *,
    auto: bool = False,
    timeout_s: int = 300,
) -> None:
    """Join a multi-process run with `jax.distributed.initialize`, before anything touches JAX.

    The three explicit values go together; `auto` lets JAX detect the cluster (SLURM, Open MPI,
    Kubernetes, Cloud TPU). With neither, this is a single-process run and nothing happens.
    """
    given = check_process_flags(coordinator_address, num_processes, process_id)
    if not given and not auto:
        return
    if given:
        host, port = split_address(coordinator_address)
        # JAX aborts the whole process (a C++ fatal error, no exception) when the coordinator
        # cannot be bound or reached, so both are checked here first, with a clear message.
        if process_id == 0:
            check_port_free(host, port)
        else:
            wait_for_coordinator(host, port, timeout_s)
    where = coordinator_address or "the detected coordinator"
    joined = threading.Event()

    def watchdog() -> None:
        if not joined.wait(timeout_s):
            error_line(
                f"not every process joined the run at {where} within {timeout_s} s; start all "
                f"{num_processes or 'of the'} processes with the same --coordinator_address and "
                "--num_processes (and distinct --process_id), or raise --distributed_timeout"
            )
            os._exit(1)  # the main thread is blocked inside JAX's C++ client

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            initialization_timeout=timeout_s + JAX_TIMEOUT_MARGIN_S,
        )
    except (RuntimeError, ValueError) as exc:  # XlaRuntimeError is a RuntimeError
        reason = errors.reason(exc)
        raise UserError(
            f"could not join the multi-process run at {where} within {timeout_s} s ({reason}); "
            "check that process 0 is running, that --coordinator_address is its host:port "
            "and reachable from here, and that --num_processes matches on every process"
        ) from None
    finally:
        joined.set()
    # JAX's preemption notifier takes SIGTERM over; give it back, so SIGTERM stops a process as
    # in a single-process run (the training loop saves and stops on it).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def check_process_flags(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> bool:
    """Whether the three explicit flags are given; they go together, the id in range."""
    explicit = {
        "--coordinator_address": coordinator_address,
        "--num_processes": num_processes,
        "--process_id": process_id,
    }
    given = [name for name, value in explicit.items() if value is not None]
    if given and len(given) < len(explicit):
        missing = ", ".join(name for name in explicit if name not in given)
        raise UserError(
            f"{', '.join(given)} given without {missing}; a multi-process run needs all three "
            "(or --distributed alone, on a cluster JAX can detect)"
        )
    if given and not 0 <= process_id < num_processes:
        raise UserError(
            f"--process_id={process_id} must be in 0..{num_processes - 1} "
            f"for --num_processes={num_processes}"
        )
    return bool(given)


def split_address(address: str) -> tuple[str, int]:
    """'10.0.0.1:1234' -> ('10.0.0.1', 1234); '[::1]:1234' works too."""
    host, _, port = address.rpartition(":")
    if not host or not errors.is_digits(port) or not 0 < int(port) < 65536:
        raise UserError(
            f"--coordinator_address={address!r} must be HOST:PORT of process 0, e.g. 10.0.0.1:1234"
        )
    return host.strip("[]"), int(port)


def check_port_free(host: str, port: int) -> None:
    """Process 0 serves the coordinator on `port`; fail clearly if something holds it."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's server does
            probe.bind(("", port))
    except OSError as exc:
        raise UserError(
            f"--coordinator_address port {port} cannot be used on this host ({exc.strerror}); "
            "pick a free port and pass the same address to every process"
        ) from None


def wait_for_coordinator(host: str, port: int, timeout_s: float) -> None:
    """Retry a TCP connection to process 0 until it answers or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(
                (host, port), timeout=max(deadline - time.monotonic(), 0.1)
            ):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"no coordinator answered at {host}:{port} within {timeout_s} s "
                    f"({exc.strerror or exc}); start process 0 first, check "
                    "--coordinator_address, or raise --distributed_timeout"
                ) from None
            time.sleep(CONNECT_RETRY_S)


def make_cpu_devices(count: int) -> int | None:
    """Give JAX's CPU backend `count` devices, before anything starts it, so an ensemble's
    members can be split over a CPU's cores as over GPUs (`--config.ensemble.shards`): each
    device then runs its own members' program on its own core instead of splitting every op
    over all of them (faster: docs/performance.md). A count the user set (XLA_FLAGS,
    JAX_NUM_CPU_DEVICES) is left as it is; GPUs are unaffected. Returns the count set, or None
    when nothing changed."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count <= 1 or "xla_force_host_platform_device_count" in flags:
        return None
    if jax.config.jax_num_cpu_devices >= 0:  # JAX_NUM_CPU_DEVICES or an earlier call
        return None
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backends already started: the mesh check says what is missing
        return None
    return count


def is_primary() -> bool:
    """Process 0 alone prints, logs and writes files; every process computes."""
    return jax.process_index() == 0


def say(*args: Any) -> None:
    """`print` (flushed) in process 0 only."""
    if is_primary():
        print(*args, flush=True)


def data_size(mesh: Mesh) -> int:
    """How many ways each batch is split: the size of the mesh's `data` axis."""
    return mesh.shape[DATA_AXIS]


def make_mesh(
    devices: list[jax.Device] | None = None,
    member_shards: int = 1,
    model_shards: int = 1,
    data_shards: int = 0,
) -> Mesh:
    """A mesh over `devices` (default: every device of every process) with the axes `member`
    (an ensemble's members split `member_shards` ways), `data` (each batch split over the
    devices left, or `data_shards` of them) and `model` (annotated parameters split
    `model_shards` ways, neighbouring devices); `member` and `model` only when larger than 1,
    so a default mesh is the 1-D `data` one."""
    devices = jax.devices() if devices is None else devices
    if len(devices) % member_shards:
        raise UserError(
            f"--config.ensemble.shards={member_shards} does not divide the {len(devices)} "
            "devices; use a divisor of both the device count and --config.ensemble.size"
        )
    left = len(devices) // member_shards
    if left % model_shards:
        where = f"the {len(devices)} devices"
        if member_shards > 1:
            where = f"the {left} devices of each of the {member_shards} member shards"
        raise UserError(
            f"--config.mesh.model={model_shards} does not divide {where}; use a divisor"
        )
    sizes = {MEMBER_AXIS: member_shards, DATA_AXIS: left // model_shards, MODEL_AXIS: model_shards}
    if data_shards not in (0, sizes[DATA_AXIS]):
        raise UserError(
            f"--config.mesh.data={data_shards}: the mesh's axes must use all {len(devices)} "
            f"devices, so with --config.mesh.model={model_shards} and "
            f"--config.ensemble.shards={member_shards} it must be {sizes[DATA_AXIS]} "
            "(or 0: the devices left)"
        )
    names = tuple(a for a in MESH_AXES if a == DATA_AXIS or sizes[a] > 1)
    shape = tuple(sizes[a] for a in names)
    types = (jax.sharding.AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, axis_types=types, devices=devices)


def mesh_for(config: Any, devices: list[jax.Device] | None = None) -> Mesh:
    """The mesh of a run's config (`config.mesh`, `config.ensemble.shards`) over `devices`."""
    check_mesh_config(config.mesh)
    return make_mesh(devices, config.ensemble.shards, config.mesh.model, config.mesh.data)


def check_mesh_config(mesh_config: Any) -> None:
    """`config.mesh`: whole sizes and a rules table `check_rules` accepts; one line each."""
    if not errors.is_whole(mesh_config.model, 1):
        raise UserError(
            f"--config.mesh.model={mesh_config.model!r} must be a whole number >= 1 (the "
            "devices each annotated parameter is split over; 1: none)"
        )
    if not errors.is_whole(mesh_config.data, 0):
        raise UserError(
            f"--config.mesh.data={mesh_config.data!r} must be a whole number >= 0 (the devices "
            "each batch is split over; 0: all those left)"
        )
    check_rules(mesh_config.rules)


def check_rules(rules: Any) -> tuple[tuple[str, str | None], ...]:
    """`config.mesh.rules` as a tuple of (logical name, mesh axis or None) pairs, each name
    once, each axis `data` or `model`; raises one line naming what is wrong."""
    flag = "--config.mesh.rules"
    example = "e.g. \"(('mlp', 'model'), ('embed', None))\""
    if isinstance(rules, str) or not isinstance(rules, tuple | list):
        raise UserError(f"{flag}={rules!r} must be (logical name, mesh axis) pairs, {example}")
    seen = set()
    for rule in rules:
        if (
            isinstance(rule, str)
            or not isinstance(rule, tuple | list)
            or len(rule) != 2
            or not isinstance(rule[0], str)
        ):
            raise UserError(f"{flag}: {rule!r} is not a (logical name, mesh axis) pair, {example}")
        name, axis = rule
        if axis not in (DATA_AXIS, MODEL_AXIS, None):
            raise UserError(
                f"{flag}: {name!r} -> {axis!r}: the mesh axis must be '{DATA_AXIS}', "
                f"'{MODEL_AXIS}' or None (replicated)"
            )
        if name in seen:
            raise UserError(f"{flag}: {name!r} is mapped twice; keep one pair per name")
        seen.add(name)
    return tuple((name, axis) for name, axis in rules)


def member_shards(mesh: Mesh) -> int:
    """How many ways an ensemble's members are split: the `member` axis (1 without one)."""
    return dict(mesh.shape).get(MEMBER_AXIS, 1)


def check_batch(batch_size: int, n: int) -> None:
    """The global batch must split evenly over the `n` devices."""
    if batch_size % n:
        lower, higher = max(n, batch_size // n * n), -(-batch_size // n) * n
        raise UserError(
            f"--batch_size={batch_size} does not divide over {n} devices; "
            f"use a multiple of {n}, e.g. {lower} or {higher}"
        )


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh."""
    return NamedSharding(mesh, P())


@functools.lru_cache(maxsize=1024)
def device_int(value: int, mesh: Mesh) -> jax.Array:
    """`value` as an int32 replicated on the mesh, made once: a Python int argument is copied
    to the device at every call, which on an accelerator costs more than the step."""
    return jax.device_put(np.int32(value), replicated(mesh))


def batch_sharding(mesh: Mesh, axis: int = 0) -> NamedSharding:
    """Split dimension `axis` (the examples) along the mesh's `data` axis."""
    return NamedSharding(mesh, P(*[None] * axis, DATA_AXIS))


def fsdp_spec(shape: tuple[int, ...], num_devices: int, free: Sequence[int] | None = None) -> P:
    """Shard a leaf's largest dimension (of the `free` ones, default all) that divides evenly;
    replicate the leaf otherwise."""
    free = range(len(shape)) if free is None else free
    candidates = [a for a in free if shape[a] % num_devices == 0]
    if num_devices == 1 or not candidates:
        return P()
    axis = max(candidates, key=lambda a: shape[a])
    return P(*[None] * axis, DATA_AXIS)


def annotated_spec(
    names: Sequence[Any],
    shape: tuple[int, ...],
    rules: Sequence[tuple[str, str | None]],
    mesh: Mesh,
) -> list[Any]:
    """A leaf's logical axis names (one per dimension: a name, a tuple of names or None) as
    mesh axes: each name through `rules` (a name no rule maps stands for itself); a mesh axis
    the mesh lacks or that does not divide its dimension evenly, or one already used, leaves
    the dimension replicated."""
    table = dict(rules)
    used: set[str] = set()

    def axes(names_of_dim: Any, size: int) -> Any:
        if names_of_dim is None:
            return None
        chosen = []
        for name in names_of_dim if isinstance(names_of_dim, tuple | list) else (names_of_dim,):
            axis = table.get(name, name)
            if axis in mesh.shape and axis not in used and mesh.shape[axis] > 1:
                chosen.append(axis)
        if not chosen or size % math.prod(mesh.shape[a] for a in chosen):
            return None
        used.update(chosen)
        return chosen[0] if len(chosen) == 1 else tuple(chosen)

    return [axes(n, size) for n, size in zip(names, shape, strict=True)]


def leaf_spec(
    leaf: Any, mesh: Mesh, param_sharding: str = "replicated", stacked: bool = False
) -> P:
    """Where one leaf of a state lives: annotated dimensions (an `nnx.Variable`'s
    `out_sharding`, through its `sharding_rules`) as `annotated_spec` says, a `stacked` leaf's
    member axis along `member` when the mesh has one, then with `param_sharding="fsdp"` the
    largest dimension left along `data`."""
    shape = tuple(leaf.shape)
    inner = shape[1:] if stacked else shape
    names = leaf.get_metadata("out_sharding", None) if isinstance(leaf, nnx.Variable) else None
    if names and len(names) != len(inner):
        raise UserError(
            f"a parameter of shape {inner} is annotated with {len(names)} axis names "
            f"{tuple(names)}: give one name (or None) per dimension"
        )
    rules = leaf.get_metadata("sharding_rules", ()) if names else ()
    spec = annotated_spec(names, inner, rules, mesh) if names else [None] * len(inner)
    if stacked:
        spec = [MEMBER_AXIS if member_shards(mesh) > 1 else None, *spec]
    if param_sharding == "fsdp" and DATA_AXIS not in spec:
        free = [a for a, axis in enumerate(spec) if axis is None]
        fsdp = fsdp_spec(shape, data_size(mesh), free)
        spec = [axis or extra for axis, extra in itertools.zip_longest(spec, fsdp)]
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def state_shardings(
    tree: Any, mesh: Mesh, param_sharding: str = "replicated", stacked: bool = False
) -> Any:
    """The NamedSharding of each leaf of a model/optimizer state (`leaf_spec`); `stacked`:
    an ensemble's, a leading member axis on each leaf."""

    def sharding(leaf: Any) -> Any:
        named = NamedSharding(mesh, leaf_spec(leaf, mesh, param_sharding, stacked))
        return leaf.replace(named) if isinstance(leaf, nnx.Variable) else named

    return jax.tree.map(sharding, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def place(tree: Any, mesh: Mesh, param_sharding: str = "replicated", stacked: bool = False) -> Any:
    """Lay a state out on the mesh: one compiled copy, so each process passes only its own
    (identical) values and gets back arrays that span every process's devices. Arrays
    committed to other devices (a checkpoint restored on one, for --init_from) go through
    the host."""
    shardings = state_shardings(tree, mesh, param_sharding, stacked)
    devices = set(mesh.devices.flat)

    def movable(x: Any) -> Any:
        elsewhere = isinstance(x, jax.Array) and x.committed and x.sharding.device_set != devices
        return np.asarray(x) if elsewhere else x

    return jax.jit(_identity, out_shardings=shardings)(jax.tree.map(movable, tree))


def _identity(tree: Any) -> Any:
    """One function object for every `place`, so JAX's caches reuse its compilations."""
    return tree


def place_module(
    modules: Any, mesh: Mesh, param_sharding: str = "replicated", stacked: bool = False
) -> None:
    """`place` the state of NNX objects (a module, or a tuple of model and optimizer) in place;
    `stacked`: an ensemble's, split by member on a `member` axis."""
    nnx.update(modules, place(nnx.state(modules), mesh, param_sharding, stacked))


def shard_host_array(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds: each process copies only the
    slices its own devices need."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def computed(tree: Any) -> bool:
    """Whether every array of `tree` is computed: fetching or waiting for it would not block."""
    return all(x.is_ready() for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def to_host(tree: Any) -> Any:
    """NumPy values of a tree of (possibly multi-process) arrays, the same in every process.
    The copies of this process's arrays all start first: one wait, not one per array."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            x.copy_to_host_async()

    def fetch(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(fetch, tree)


@functools.partial(jax.jit, compiler_options=compilation_cache.QUICK_COMPILE)
def finite(tree: Any) -> jax.Array:
    """Whether every value of every array of `tree` is finite, as one boolean on the devices
    (compiled quickly: it runs once a save or a restore)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def all_finite(tree: Any) -> bool:
    """Whether every value of every array of `tree` is finite (checked on the devices)."""
    return not jax.tree.leaves(tree) or bool(to_host(finite(tree)))


def check_replicas(tree: Any, what: str) -> int:
    """Fail loudly if the copies of a replicated array differ, between the devices of this
    process or between processes, or the copies of one shard of a split array (a `model`-split
    kernel's along `data`) between the devices of this process; returns how many replicated
    arrays were compared."""
    local = []
    for x in jax.tree.leaves(tree):
        copies: dict[str, list[np.ndarray]] = {}  # each shard's copies (FSDP's: one each)
        for shard in x.addressable_shards:
            copies.setdefault(str(shard.index), []).append(np.asarray(shard.data))
        for same in copies.values():
            if not all(np.array_equal(same[0], c) for c in same[1:]):
                raise RuntimeError(f"{what} differ between the devices of this process")
        if x.is_fully_replicated:
            local.append(next(iter(copies.values()))[0])
    if jax.process_count() > 1:
        multihost_utils.assert_equal(local, f"{what} differ between processes")
    return len(local)


def from_every_process(value: int) -> list[int]:
    """One host integer from each process, in process order (a caught signal, a count)."""
    if jax.process_count() == 1:
        return [value]
    return np.asarray(multihost_utils.process_allgather(np.int32(value))).tolist()


def sync(name: str) -> None:
    """Wait until every process reaches this point (no-op in a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def layout(mesh: Mesh, batch_size: int, param_sharding: str) -> str:
    """One line on how the run is laid out, for the terminal and summary.json."""
    kinds = sorted({d.platform for d in mesh.devices.flat})
    processes = jax.process_count()
    where = f"{mesh.size} {'/'.join(kinds)} device(s)"
    if processes > 1:
        where += f" in {processes} processes ({len(jax.local_devices())} in this one)"
    params = "sharded along it (FSDP)" if param_sharding == "fsdp" else "replicated"
    if member_shards(mesh) > 1:
        within = "sharded along `data`" if param_sharding == "fsdp" else "replicated"
        params = f"split by member along `member` ({within} within)"
    if MODEL_AXIS in mesh.shape:
        params += (
            ", except annotated ones: split as config.mesh.rules map their axis names (the "
            "model table and summary.json's param_layouts give each one's layout)"
        )
    return (
        f"mesh {dict(mesh.shape)} over {where}; batch {batch_size:,} split "
        f"{batch_size // data_size(mesh):,} per device; parameters and optimizer state {params}"
    )


def param_layouts(model: nnx.Module) -> dict[str, str]:
    """Each parameter's layout on its mesh ('layers.0.kernel': "P(None, 'model')", or
    'replicated'), for summary.json."""
    return {
        ".".join(map(str, path)): (
            "replicated" if v[...].sharding.is_fully_replicated else str(v[...].sharding.spec)
        )
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
