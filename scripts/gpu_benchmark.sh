#!/usr/bin/env bash
# docs/performance.md's GPU measurements in one command:
#
#   bash scripts/gpu_benchmark.sh   # after `bash scripts/stage_gpu_run.sh` staged .whl/ and .data/
#
# 1. installs the carried wheels (.whl/) whose packages the image lacks or holds at another
#    version, into $SITE (no network), which goes first on PYTHONPATH;
# 2. finds the carried Fashion-MNIST files ($DATA_DIR) and trains a 2-member ensemble for 20
#    steps, which stops the script at once where the image's packages do not fit the code;
# 3. `main.py --mode=benchmark` at batch 512, 32 and 4096, float32 and bfloat16: the codelab loop,
#    the plain nnx.jit step, the fused path and every other path it times (8-member ensembles
#    too: on a GPU, where one member is launch-bound, 8 should cost about one's time, >= 6x in
#    member-examples/s; Grain from record files, and its pipeline alone, which should feed
#    well over what the fused path consumes on a host whose cores the GPU leaves free; the
#    record reader alone on 1, 2, 4 and 8 threads, as the host's cores allow), plus its
#    whole-run comparison (400 steps, cold and warm compilation caches, as subprocesses), the
#    training loop as main.py runs it against the fused path, and a logged row's host cost;
# 4. `main.py --steps=400 --report=basic`: test accuracy and training examples/s;
# 5. kernels per step and microseconds per kernel of the fused path, from a jax.profiler trace;
# 6. prints one markdown table ($OUT/table.md) with all of it.
#
# Environment: OUT (default ./gpu-bench-out), PYTHON (python3), DATA_DIR (first of
# ./.data/fashion-mnist, /usr/share/datasets/fashion-mnist), SMALL=1 (a quick check on a CPU:
# batches 32,64, few steps, 2 members), BATCH_SIZES, DTYPES, MEMBERS, MEMBER_SHARDS (the
# ensembles also split over that many devices; default 1: one chip), BENCH_STEPS,
# BENCH_REPEATS, WHOLE_RUN_STEPS, RUN_STEPS, KERNEL_STEPS, BUDGET_S (seconds for all phases,
# default 460), BENCH_CAP_S (of which the benchmark suite's, default 330), SITE (/tmp/site),
# INSTALL_ALL=1 (install every carried wheel, even at the installed version), ALLOW_CPU=1 (run
# the full sizes without a GPU). A phase that fails or runs out of time leaves "not measured"
# cells and a non-zero exit status, after the table; a failed 20-step run first stops it
# (exit 4).
set -euo pipefail

START_DIR=$PWD
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-./gpu-bench-out}
[[ $OUT = /* ]] || OUT=$START_DIR/$OUT
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SITE=${SITE:-/tmp/site}
SMALL=${SMALL:-0}
if [[ $SMALL = 1 ]]; then
  : "${BATCH_SIZES:=32,64}" "${BENCH_STEPS:=5}" "${BENCH_REPEATS:=3}" "${WHOLE_RUN_STEPS:=0}"
  : "${MEMBERS:=2}"
  : "${RUN_STEPS:=20}" "${KERNEL_STEPS:=10}"
else
  : "${BATCH_SIZES:=512,32,4096}" "${BENCH_STEPS:=400}" "${BENCH_REPEATS:=3}" "${MEMBERS:=8}"
  : "${WHOLE_RUN_STEPS:=400}" "${RUN_STEPS:=400}" "${KERNEL_STEPS:=100}"
fi
DTYPES=${DTYPES:-float32,bfloat16}
MEMBER_SHARDS=${MEMBER_SHARDS:-1}
BUDGET_S=${BUDGET_S:-460}
BENCH_CAP_S=${BENCH_CAP_S:-330}
# Each process takes GPU memory as it needs it: the benchmark's whole-run subprocesses start
# while it still holds its own.
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-1}
log() { printf '[gpu_benchmark %3ds] %s\n' "$SECONDS" "$*" >&2; }

# --- 1. wheels ---------------------------------------------------------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
  mapfile -t MISSING < <(INSTALL_ALL=${INSTALL_ALL:-0} "$PY" - .whl/*.whl <<'EOF'
import importlib.metadata as md
import os
import pathlib
import sys

present = []
for wheel in sys.argv[1:]:
    name, version = pathlib.Path(wheel).name.split("-")[:2]
    try:
        installed = md.version(name)
    except md.PackageNotFoundError:
        installed = None
    if installed == version and os.environ["INSTALL_ALL"] != "1":
        present.append(f"{name} {installed}")
    else:
        print(wheel)
        if installed:
            print(f"[gpu_benchmark] {name} {installed} -> {version}", file=sys.stderr)
print(f"[gpu_benchmark] already installed: {', '.join(present) or 'none'}", file=sys.stderr)
EOF
  )
  if ((${#MISSING[@]})); then
    log "installing into $SITE: ${MISSING[*]#.whl/}"
    if "$PY" -m pip --version >/dev/null 2>&1; then
      PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" "${MISSING[@]}"
    else  # no pip: a wheel is a zip laid out for site-packages
      "$PY" -c 'import sys, zipfile
for w in sys.argv[2:]: zipfile.ZipFile(w).extractall(sys.argv[1])' "$SITE" "${MISSING[@]}"
    fi
  fi
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi

# --- 2. data -----------------------------------------------------------------------------
if [[ -z ${DATA_DIR:-} ]]; then
  for dir in ./.data/fashion-mnist /usr/share/datasets/fashion-mnist; do
    if compgen -G "$dir/train-images-idx3-ubyte*" >/dev/null; then DATA_DIR=$dir; break; fi
  done
fi
if [[ -z ${DATA_DIR:-} ]] || ! compgen -G "$DATA_DIR/t10k-labels-idx1-ubyte*" >/dev/null; then
  echo "gpu_benchmark: no Fashion-MNIST files in ${DATA_DIR:-./.data/fashion-mnist or" \
    "/usr/share/datasets/fashion-mnist}; run scripts/stage_gpu_run.sh and carry .data" >&2
  exit 2
fi
DATA_DIR=$(cd "$DATA_DIR" && pwd)
log "data: $DATA_DIR; out: $OUT; python: $PY"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader | tee "$OUT/nvidia-smi.txt" >&2 || true
if ! BACKEND=$("$PY" -c 'import jax; print(jax.default_backend())' 2>"$OUT/jax.err" | tail -n 1)
then
  tail -n 3 "$OUT/jax.err" >&2
  echo "gpu_benchmark: $PY cannot import jax (see $OUT/jax.err);" \
    "PYTHON=... names another interpreter" >&2
  exit 3
fi
log "JAX backend: $BACKEND"
if [[ $BACKEND != gpu && $SMALL != 1 && ${ALLOW_CPU:-0} != 1 ]]; then
  echo "gpu_benchmark: JAX sees no GPU (backend $BACKEND); the full sizes take far longer" \
    "on a CPU. SMALL=1 for a quick check, ALLOW_CPU=1 to go on anyway" >&2
  exit 3
fi

# A 20-step run of a 2-member ensemble first: an image whose packages do not fit the code
# fails here in seconds, not in every phase after it.
SMOKE_DIR=$(mktemp -d)
if ! timeout -k 10 120 "$PY" main.py --steps=20 --report=none --config.ensemble.size=2 \
  --data_dir="$DATA_DIR" --workdir="$SMOKE_DIR" >"$OUT/smoke.log" 2>&1; then
  tail -n 15 "$OUT/smoke.log" >&2
  rm -rf "$SMOKE_DIR"
  echo "gpu_benchmark: a 20-step run failed (whole log: $OUT/smoke.log); nothing else ran" >&2
  exit 4
fi
rm -rf "$SMOKE_DIR"
log "a 20-step run of 2 members: $(grep -m 1 -o 'test accuracy [0-9.]*' "$OUT/smoke.log" || echo ran)"

# Each phase gets at most its cap and never more than what is left of BUDGET_S.
FAILED=()
phase() {  # phase NAME CAP_S LOG COMMAND...
  local name=$1 cap=$2 logfile=$3 left=$((BUDGET_S - SECONDS)) rc=0
  shift 3
  ((left < cap)) && cap=$left
  if ((cap < 10)); then log "$name: skipped, out of time"; FAILED+=("$name"); return 0; fi
  log "$name: started (at most ${cap}s)"
  timeout -k 10 "$cap" "$@" 2>"$logfile.err" | tee "$logfile" || rc=$?
  if ((rc)); then
    log "$name: failed (exit $rc; 124: out of time); last lines of $logfile.err:"
    tail -n 5 "$logfile.err" >&2
    FAILED+=("$name")
  fi
  log "$name: done"
}

# --- 3. the benchmark suite --------------------------------------------------------------
rm -f "$OUT/bench.json"
phase benchmark "$BENCH_CAP_S" "$OUT/bench.log" "$PY" main.py --mode=benchmark \
  --data_dir="$DATA_DIR" --bench_batch_sizes="$BATCH_SIZES" --bench_dtypes="$DTYPES" \
  --bench_steps="$BENCH_STEPS" --bench_repeats="$BENCH_REPEATS" \
  --bench_whole_run_steps="$WHOLE_RUN_STEPS" --bench_members="$MEMBERS" \
  --bench_member_shards="$MEMBER_SHARDS" --output="$OUT/bench.json"

# --- 4. one training run, as a user starts it ----------------------------------------------
rm -rf "$OUT/run" # a workdir with a finished run would be returned as it is, not run again
RUN_START=$SECONDS
phase "${RUN_STEPS}-step run" 120 "$OUT/run.log" "$PY" main.py --steps="$RUN_STEPS" \
  --report=basic --data_dir="$DATA_DIR" --workdir="$OUT/run"
echo "$((SECONDS - RUN_START))" >"$OUT/run_wall_s.txt"

# --- 5. kernels per step of the fused path, from a jax.profiler trace ------------------------
rm -rf "$OUT/traces"
phase kernels 90 "$OUT/kernels.log" "$PY" - "$OUT/traces" "$DATA_DIR" "$KERNEL_STEPS" \
  "$BATCH_SIZES" "$DTYPES" <<'EOF'
import collections
import gzip
import json
import pathlib
import re
import sys

import jax

from fmnist_flax import config as config_lib
from fmnist_flax import datasets
from fmnist_flax.codelab import benchmark
from fmnist_flax.runtime import device_batches, parallel


def count(path: pathlib.Path, steps: int) -> dict:
    """Kernels in a perfetto trace: on a GPU what ran on its streams (copies apart); with no
    GPU lines (a CPU) the fused chunk's XLA op events on the host (thunks, all threads)."""
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e["name"] in ("process_name", "thread_name")}  # fmt: skip
    gpu = {pid for (pid, tid), name in names.items() if tid is None and "/device:GPU" in name}
    timed = [(e, names.get((e["pid"], e.get("tid")), "?")) for e in events if e.get("ph") == "X"]
    if gpu:
        ops = [(e, n) for e, n in timed if e["pid"] in gpu]
        ops = [(e, n) for e, n in ops if n.startswith("Stream")] or ops
    else:
        ops = [(e, n) for e, n in timed if "train_chunk" in e.get("args", {}).get("hlo_module", "")]
    kernels = [e for e, _ in ops if not re.search("mem(cpy|set)", e["name"], re.I)]
    return {"device": "gpu" if gpu else "host", "kernels_per_step": len(kernels) / steps,
            "copies_per_step": (len(ops) - len(kernels)) / steps,
            "us_per_kernel": sum(e.get("dur", 0) for e in kernels) / max(len(kernels), 1),
            "events_by_line": collections.Counter(n for _, n in ops)}  # fmt: skip


out, steps, rows = pathlib.Path(sys.argv[1]), int(sys.argv[3]), []
config = config_lib.get_config()
config.data_dir = sys.argv[2]
dataset, mesh = datasets.load(config), parallel.make_mesh(jax.devices()[:1])
for batch in map(int, sys.argv[4].split(",")):
    data = device_batches.to_device(dataset, batch, mesh)
    for dtype in sys.argv[5].split(","):
        config.batch_size, config.compute_dtype = batch, dtype
        run, trace_dir = benchmark.fused_runner(config, data), out / f"b{batch}-{dtype}"
        jax.block_until_ready(run(steps))  # compile and warm up
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            jax.block_until_ready(run(steps))
        [path] = trace_dir.rglob("perfetto_trace.json.gz")
        rows.append({"batch_size": batch, "dtype": dtype, "steps": steps, "trace": str(path)})
        rows[-1].update(count(path, steps))
        print(json.dumps(rows[-1]), flush=True)
(out / "kernels.json").write_text(json.dumps(rows, indent=1))
EOF

# --- 6. the table --------------------------------------------------------------------------
"$PY" - "$OUT" "$RUN_STEPS" <<'EOF' | tee "$OUT/table.md"
import json
import pathlib
import re
import sys

out, run_steps = pathlib.Path(sys.argv[1]), sys.argv[2]
CODELAB, JIT, FUSED = "codelab loop (reference)", "nnx.jit step", "fused (default)"
NM = "not measured"


def load(path):
    try:
        return json.loads((out / path).read_text())
    except (OSError, ValueError):
        return None


def num(value):
    return NM if value is None else f"{value:,.0f}"


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else NM


bench, summary = load("bench.json"), load("run/summary.json")
kernels = {(k["batch_size"], k["dtype"]): k for k in load("traces/kernels.json") or []}
rates = {}  # (batch, dtype) -> {path: examples/s}, paths in the benchmark's order
timed_beside = {}  # (batch, dtype, path) -> an ensemble's ratio to a fused member timed beside it
if bench:
    for r in bench["results"]:
        rates.setdefault((r["batch_size"], r["dtype"]), {})[r["path"]] = r["examples_per_sec"]
        if r.get("fused_beside_per_sec"):
            timed_beside[r["batch_size"], r["dtype"], r["path"]] = f"{r['ratio_to_fused']:.2f}x"
elif (out / "bench.log").exists():  # cut short: the rates it printed as it went
    text = (out / "bench.log").read_text()
    for m in re.finditer(r"^  (.+?) +B=(\d+) +(\w+) +([\d,]+) examples/s$", text, re.M):
        rates.setdefault((int(m[2]), m[3]), {})[m[1]] = float(m[4].replace(",", ""))
paths = list(dict.fromkeys([CODELAB, JIT, FUSED, *(p for r in rates.values() for p in r)]))
ENSEMBLE = next((p for p in paths if p.startswith("ensemble") and "shared" in p), "ensemble")
header = ["run", "batch", "dtype", *(f"{p} ex/s" for p in paths), "fused vs codelab",
          "nnx.jit vs codelab", f"{ENSEMBLE} vs fused", "fused kernels/step", "us/kernel",
          "test accuracy"]  # fmt: skip
rows = []
for (batch, dtype), r in rates.items():
    k = kernels.get((batch, dtype))
    rows.append(["benchmark", batch, dtype, *(num(r.get(p)) for p in paths),
                 f"**{ratio(r.get(FUSED), r.get(CODELAB))}**", ratio(r.get(JIT), r.get(CODELAB)),
                 timed_beside.get((batch, dtype, ENSEMBLE),
                                  ratio(r.get(ENSEMBLE), r.get(FUSED))),
                 f"{k['kernels_per_step']:.1f}" if k else NM,
                 f"{k['us_per_kernel']:.1f}" if k else NM, ""])  # fmt: skip
if not rates:
    rows.append(["benchmark", "", "", *[NM] * len(paths), NM, NM, NM, NM, NM, ""])
run = [""] * len(header)
run[0] = f"main.py --steps={run_steps} --report=basic"
run[header.index(f"{FUSED} ex/s")], run[-1] = NM, NM
if summary:
    wall = (out / "run_wall_s.txt").read_text().strip()
    run[:3] = [f"{run[0]} (wall {wall} s)", summary["batch_size"], summary["compute_dtype"]]
    run[header.index(f"{FUSED} ex/s")] = num(summary["train_examples_per_sec"])
    run[-1] = f"**{summary['test_accuracy']:.4f}**"
rows.append(run)

if bench:
    versions = bench.get("versions", {})
    about = [f"backend {bench['backend']} ({bench['device']})",
             f"matmul peak {bench['matmul_peak_gflops']:,.0f} GFLOP/s",
             ", ".join(f"{k} {versions[k]}" for k in ("jax", "flax", "optax") if k in versions),
             bench.get("date", "")]  # fmt: skip
else:
    about = ["benchmark JSON missing"]
print(f"\n### GPU benchmark: {'; '.join(a for a in about if a)}\n")
for cells in (header, ["---"] * len(header), *rows):
    print("| " + " | ".join(str(c) for c in cells) + " |")
print()
if not kernels:
    print("kernels per step: not measured")
elif next(iter(kernels.values()))["device"] != "gpu":
    print("kernels: the trace had no GPU lines, so these are the fused chunk's XLA op events on")
    print("the host per step (on a CPU: its thunks, over all threads)")
if bench and bench.get("whole_run"):
    w = bench["whole_run"]
    walls = "; ".join(f"{n} {r['wall_seconds']:.1f} s" for n, r in w["runs"].items())
    print(
        f"whole runs of {w['steps']} steps, start to exit: {walls} (main.py / plain JAX "
        f"{w['wall_ratio_cold']:.2f}x cold, {w['wall_ratio_warm']:.2f}x warm)"
    )
if bench and bench.get("record_reads"):
    reads = "; ".join(
        f"{r['threads']} threads {r['records_per_sec']:,.0f} ({r['ratio_to_one']:.2f}x one, "
        f"controls: SHA-256 {r['control_ratio']:.2f}x, gather {r['gather_ratio']:.2f}x)"
        for r in bench["record_reads"]
    )
    print(f"record reader alone, records/s: {reads}")
if bench and bench.get("loop"):
    lp, lg = bench["loop"], bench["logging"]
    print(
        f"training loop as main.py runs it: {lp['loop_examples_per_sec']:,.0f} ex/s, "
        f"{lp['ratio']:.2f}x the fused path beside it; per logged row the loop spends "
        f"{lg['handed_over_us']:.0f} us ({lg['in_loop_us']:.0f} us writing it in the loop)"
    )
print(f"ex/s: training examples per second, median of repeats; files in {out}")
EOF

log "total ${SECONDS}s"
if ((${#FAILED[@]})); then
  log "failed or skipped: ${FAILED[*]}"
  exit 1
fi
