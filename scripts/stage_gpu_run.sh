#!/usr/bin/env bash
# Stage, on a machine with network, what `scripts/gpu_benchmark.sh` needs on a GPU machine
# without one: the wheels a JAX + Flax + Optax + Orbax image may lack in .whl/ and the four
# Fashion-MNIST files in .data/fashion-mnist/, both kept out of git through .git/info/exclude
# and carried to the GPU machine as ignored paths (64 MiB per run in all).
#
#   bash scripts/stage_gpu_run.sh        # then, on the GPU machine: bash scripts/gpu_benchmark.sh
#
# Versions are pinned to the ones the project is tested with (.venv); the GPU machine runs
# CPython 3.12 on x86-64, hence the platform flags. The benchmark installs only the ones its
# image lacks or holds at another version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SRC_DATA=${SRC_DATA:-/usr/share/datasets/fashion-mnist}

# The project's dependencies (pyproject.toml) at the versions it is tested with, with their
# own dependencies that jax, flax, optax and orbax-checkpoint do not already bring (those bring
# numpy, absl-py, protobuf, etils, psutil, PyYAML, msgpack, rich, tensorstore). JAX, Flax,
# Optax and Orbax are the image's: its CUDA plugin must match its jaxlib, and a Flax must match
# its JAX (2026-12-04: flax 0.12.8 failed to import under the image's jax 0.11.2; its own flax
# 0.12.10 ran everything). The benchmark installs a wheel only when its package is missing or
# at another version.
WHEELS=(
  ml-collections==1.1.0   # configs and --config flags
  tensorboardX==2.6.5     # summaries; needs numpy, packaging, protobuf
  protobuf==7.36.2        # tensorboardX's (orbax-checkpoint's too, so usually present)
  packaging==26.4         # tensorboardX's and matplotlib's
  flatbuffers==25.12.19   # jax.export's serialization (--mode=export)
  absl-py==2.5.1          # flags and logging (optax's dependency too, so usually present)
  grain==0.2.18           # config.input_pipeline="grain"; imported by the training path
  array_record==0.8.6     # grain's
  cloudpickle==3.1.3      # grain's
  portpicker==1.6.0       # grain's (its psutil comes with orbax-checkpoint)
  matplotlib==3.11.2      # the report's figures (--report=basic writes them)
  contourpy==1.3.3        # matplotlib's
  cycler==0.12.1          # matplotlib's
  fonttools==4.68.0       # matplotlib's
  kiwisolver==1.5.1       # matplotlib's
  pillow==13.0.0          # matplotlib's; --mode=predict reads PNGs with it
  pyparsing==3.3.3        # matplotlib's
  python-dateutil==4.0.0  # matplotlib's
  tzdata==2026.6          # python-dateutil's
)

mkdir -p .whl .data/fashion-mnist .git/info
touch .git/info/exclude
for pattern in /.whl/ /.data/ /gpu-bench-out/; do
  grep -qxF "$pattern" .git/info/exclude || echo "$pattern" >>.git/info/exclude
done

cp -u "$SRC_DATA"/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz .data/fashion-mnist/

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"

ls -1 .whl
du -sh .whl .data
du -shc .whl .data | tail -n 1
