"""Side by side in one process: main.py's fused training path at another commit and now.

    .venv/bin/python scripts/compare_speed.py BASE_REV [--batch_sizes=512,32] [--pairs=15]

On a shared machine the load moves whole runs within minutes by far more than the differences
worth measuring, so two processes timed one after the other cannot tell them apart. This loads
the package of BASE_REV (a git worktree, renamed `fmnist_flax_base`) beside this checkout's,
builds each one's `benchmark.fused_runner` (the compiled chunk main.py trains with) on the same
data, and alternates timed epochs of the two, printing the median ratio of the pairs. Both
commits need `benchmark.fused_runner(config, device_data)`.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES_PER_WINDOW = 60_000  # one epoch of Fashion-MNIST per timed window


def base_package(rev: str, into: pathlib.Path) -> None:
    """BASE_REV's fmnist_flax under `into` as `fmnist_flax_base`, its imports renamed."""
    tree = into / "tree"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "-f", "--detach", str(tree), rev],
        check=True,
        capture_output=True,
    )
    try:
        shutil.copytree(tree / "fmnist_flax", into / "fmnist_flax_base")
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
            check=True,
            capture_output=True,
        )
    for path in (into / "fmnist_flax_base").rglob("*.py"):
        path.write_text(re.sub(r"\bfmnist_flax\b", "fmnist_flax_base", path.read_text()))


def module(package: str, name: str):
    """`package`'s module `name`, in its folder (runtime/, codelab/) or, at older commits, in the
    package itself."""
    import importlib.util

    for folder in ("runtime.", "codelab.", ""):
        try:
            if importlib.util.find_spec(f"{package}.{folder}{name}") is not None:
                return importlib.import_module(f"{package}.{folder}{name}")
        except ModuleNotFoundError:  # no such folder at that commit
            continue
    raise ModuleNotFoundError(f"{package} has no module {name}")


def runner(package: str, batch_size: int):
    """That package's fused runner for the default config at `batch_size`, warmed up."""
    import jax

    modules = {
        n: module(package, n)
        for n in ("benchmark", "config", "datasets", "input_pipeline", "parallel")
    }
    config = modules["config"].get_config()
    config.batch_size = batch_size
    dataset = modules["datasets"].load_dataset(download=False)
    mesh = modules["parallel"].make_mesh(jax.devices()[:1])
    run = modules["benchmark"].fused_runner(
        config, modules["input_pipeline"].to_device(dataset, batch_size, mesh)
    )
    for _ in range(2):
        jax.block_until_ready(run(2))
    return run


def compare(batch_size: int, pairs: int) -> None:
    import jax

    runs = {
        "base": runner("fmnist_flax_base", batch_size),
        "now": runner("fmnist_flax", batch_size),
    }
    steps = EXAMPLES_PER_WINDOW // batch_size
    times = {name: [] for name in runs}
    for pair in range(pairs):
        for name in ("base", "now") if pair % 2 == 0 else ("now", "base"):
            start = time.perf_counter()
            jax.block_until_ready(runs[name](steps))
            times[name].append(time.perf_counter() - start)
    ratios = [b / n for b, n in zip(times["base"], times["now"], strict=True)]
    base, now = (statistics.median(times[name]) for name in ("base", "now"))
    print(
        f"batch {batch_size}: {steps} steps per window, base {base:.3f} s, now {now:.3f} s; "
        f"now's speed / base's: median of {pairs} pairs {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f} to {max(ratios):.3f})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the commit to compare with, e.g. HEAD~1")
    parser.add_argument("--batch_sizes", default="512,32")
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        base_package(args.base, pathlib.Path(directory))
        sys.path.insert(0, directory)
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            compare(batch_size, args.pairs)


if __name__ == "__main__":
    main()
