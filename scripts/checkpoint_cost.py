"""What the checksum of each saved array costs, side by side in one process: saving and
restoring the CNN of configs/cnn.py and an MLP of about 100 M parameters, with and without it.

    .venv/bin/python scripts/checkpoint_cost.py [--repeats=5] [--dir=/tmp]

Each repeat saves a model and its optimizer state (AdamW: two more arrays per parameter) as a
training run does (`Checkpoints.save`, then `wait`: until the step is on disk) and restores both
as a resume does (`restore.restore`), once with checksums and once without (their computation
left out: the step then records none, and its restore checks none), the two alternating so
that a change of the machine's load falls on both. It prints the median and the range of each
and the checksums' own time. The restore reads files the save has just written, from the page
cache, as a resume right after a save does.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import runpy
import statistics
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
WIDE_HIDDEN = (10240, 8960)  # 784-10240-8960-10: 99.9 M parameters


def models():
    """(name, config) of each model measured."""
    from fmnist_flax import config as default_config

    cnn = runpy.run_path(str(REPO / "configs" / "cnn.py"))["get_config"]()
    wide = default_config.get_config()
    wide.model.hidden = WIDE_HIDDEN
    return [("CNN (configs/cnn.py)", cnn), ("MLP 784-10240-8960-10", wide)]


@contextlib.contextmanager
def checksums_off(checkpoint):
    """Saves record no checksums (so restores check none) while the block runs."""
    computed = checkpoint.checksums
    checkpoint.checksums = lambda tree: None
    try:
        yield
    finally:
        checkpoint.checksums = computed


def measure(config, repeats: int, root: pathlib.Path) -> dict[str, list[float]]:
    """Seconds of each save, restore and checksum computation, by whether checksums are on."""
    from flax import nnx

    from fmnist_flax import train
    from fmnist_flax.runtime import checkpoint, parallel, restore
    from fmnist_flax.runtime.schedule import Schedule

    model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
    progress = Schedule(config, 117).progress(1)
    arrays = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
    times: dict[str, list[float]] = {}
    for repeat in range(-1, repeats):  # -1: a first round, not kept (compiles, first writes)
        for on in (repeat % 2 == 0, repeat % 2 != 0):  # which one goes first alternates
            label = "with" if on else "without"
            workdir = root / f"{label}{repeat}"
            with contextlib.nullcontext() if on else checksums_off(checkpoint):
                writer = checkpoint.Checkpoints(workdir, max_to_keep=1)
                began = time.perf_counter()
                writer.save(1, model, optimizer, progress)
                writer.wait()
                saving = time.perf_counter() - began
                writer.close()
                reader = checkpoint.Checkpoints(workdir, read_only=True)
                began = time.perf_counter()
                restored = restore.restore(reader, {**arrays, "progress": None})
                restoring = time.perf_counter() - began
                reader.close()
            assert restored["step"] == 1
            assert (workdir / "checkpoints" / "1" / checkpoint.CHECKSUMS).is_dir() == on
            if repeat >= 0:
                times.setdefault(f"save {label}", []).append(saving)
                times.setdefault(f"restore {label}", []).append(restoring)
        began = time.perf_counter()
        for tree in arrays.values():
            checkpoint.checksums(checkpoint.key_data(tree))
        if repeat >= 0:
            times.setdefault("checksums alone", []).append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the steps are written (a tmp dir)")
    args = parser.parse_args()
    import jax
    from flax import nnx

    from fmnist_flax import train
    from fmnist_flax.runtime import parallel

    for name, config in models():
        model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
        params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        saved = sum(x.nbytes for x in jax.tree.leaves((nnx.state(model), nnx.state(optimizer))))
        del model, optimizer
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            times = measure(config, args.repeats, pathlib.Path(root))
        print(f"{name}: {params:,} parameters, {saved / 2**20:,.1f} MiB saved per step")
        for what, seconds in sorted(times.items()):
            print(
                f"  {what:16s} median {statistics.median(seconds):7.3f} s  "
                f"range {min(seconds):.3f}-{max(seconds):.3f} s  ({len(seconds)} repeats)"
            )


if __name__ == "__main__":
    main()
