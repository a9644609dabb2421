"""Where the fused step's time goes: a `jax.profiler` trace summed per kind of XLA op.

Used by `--mode=benchmark`; each op event of the trace is mapped to the compiled module's
instruction it belongs to and classified as a matmul, weight-shaped elementwise work (AdamW)
or everything else.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
from flax import nnx

from fmnist_flax import input_pipeline, train
from fmnist_flax.runtime import device_batches
from fmnist_flax.runtime.tables import Table

OP_KINDS = ("matmul", "elementwise over kernels", "everything else")
PROFILE_STEPS = 50
CONTAINER_OPS = {"while", "conditional", "call"}  # their time is their children's
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^=]*?\)|\S+) ([\w\-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def op_kinds(hlo_text: str, kernel_shapes: set[tuple[int, ...]]) -> dict[str, str]:
    """Each instruction of a compiled module -> its kind: a matmul (a dot or convolution, or a
    fusion around one), elementwise work shaped like a weight matrix (AdamW's moments and
    update, the gradient norm: it scales with the parameters, not the batch), or the rest."""
    calls_matmul = collections.defaultdict(bool)
    instructions = {}
    current = ""
    for line in hlo_text.splitlines():
        if header := _COMPUTATION.match(line):
            current = header.group(1)
        elif found := _INSTRUCTION.match(line):
            name, shape, opcode = found.groups()
            called = (_CALLS.search(line) or [None, None])[1]
            calls_matmul[current] |= opcode in ("dot", "convolution")
            instructions[name] = (shape, opcode, called)
    kinds = {}
    for name, (shape, opcode, called) in instructions.items():
        dims = {
            tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"\[([\d,]*)\]", shape)
        }
        if opcode in CONTAINER_OPS:
            continue
        if opcode in ("dot", "convolution") or calls_matmul[called]:
            kinds[name] = OP_KINDS[0]
        elif dims & kernel_shapes:
            kinds[name] = OP_KINDS[1]
        else:
            kinds[name] = OP_KINDS[2]
    return kinds


def profile_fused(
    train_state: tuple[nnx.Module, nnx.Optimizer],
    device_data: input_pipeline.DeviceData,
    config: ml_collections.ConfigDict,
    steps: int = PROFILE_STEPS,
) -> dict[str, float]:
    """Trace `steps` fused steps of a fresh model with jax.profiler and sum the time of each
    op kind, in microseconds per step (trace events that name no op of the module are left
    out: Python, dispatch, the loop's own bookkeeping)."""
    model, optimizer = train_state
    # A weight matrix whose rows equal the batch size looks like an activation: left out.
    kernel_shapes = {
        tuple(k.shape)
        for k in jax.tree.leaves(nnx.state(model))
        if k.ndim > 1 and k.shape[0] != device_data.batch_size
    }
    graphdef, state = train.split_state(model, optimizer)
    frozen = ml_collections.FrozenConfigDict(config)
    chunk = train.make_train_chunk(graphdef, frozen, device_data.image_shape, device_data.mesh)
    sums = train.zero_sums(model, frozen, device_data.image_shape, device_data.mesh)
    order = device_batches.epoch_order(0, 0, len(device_data.train_labels))
    steps = min(steps, device_data.batches_per_epoch)
    args = (sums, device_data.train_images, device_data.train_labels, order, 0, steps)
    # Run the very executable whose text names the ops, so every event maps onto it.
    compiled = chunk.lower(state, *args).compile()
    kinds = op_kinds(compiled.as_text(), kernel_shapes)
    state, _, _ = compiled(state, *args)  # warm before the trace
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(compiled(state, *args))
        [trace] = pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz")
        events = json.loads(gzip.decompress(trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    totals = dict.fromkeys(OP_KINDS, 0.0)
    for event in events:
        name = event.get("args", {}).get("hlo_op", event.get("name"))
        if event.get("ph") == "X" and name in kinds:
            totals[kinds[name]] += event.get("dur", 0) / steps
    return totals


def profile_table(profiles: Sequence[dict[str, Any]]) -> str:
    rows = []
    for p in profiles:
        ops = p["op_us_per_step"]
        share = ops[OP_KINDS[0]] / sum(ops.values()) if sum(ops.values()) else float("nan")
        rows.append(
            (
                p["batch_size"],
                p["dtype"],
                *(f"{ops[k]:,.0f}" for k in OP_KINDS),
                f"{p['wall_us_per_step']:,.0f}",
                f"{share:.0%}",
            )
        )
    return Table.of(
        "Where the fused step's time goes (jax.profiler trace: each op kind's time summed over "
        "threads, microseconds per step)",
        ("Batch", "Dtype", *(k.capitalize() for k in OP_KINDS), "Wall", "Matmul share"),
        rows,
    ).format()
