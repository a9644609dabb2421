"""The training loop as main.py runs it (logging, saves, evaluations left out of its rate)
against the fused path, alternated in one process: on a TPU, where one program at a time may
hold the chip, this is the whole-run comparison `--mode=benchmark` makes with subprocesses.

    PYTHONPATH=. python scripts/loop_vs_fused.py --steps=2000 [--batch_size=512] [--data_dir=DIR]

Prints one JSON object: each side's median examples/s and the median of their ratios.
"""

from __future__ import annotations

import argparse
import json

import jax

from fmnist_flax import config as config_lib
from fmnist_flax import datasets
from fmnist_flax.codelab import benchmark
from fmnist_flax.runtime import device_batches, parallel, workdir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch_size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data_dir", default="")
    args = parser.parse_args()
    config = config_lib.get_config()
    config.update(batch_size=args.batch_size, data_dir=args.data_dir)
    dataset = datasets.load(config)
    mesh = parallel.mesh_for(config, jax.devices()[:1])
    device_data = device_batches.to_device(dataset, config.batch_size, mesh)
    result = benchmark.whole_loop(config, device_data, args.steps, args.repeats)
    result |= {"device": str(jax.devices()[0]), "versions": workdir.versions()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
