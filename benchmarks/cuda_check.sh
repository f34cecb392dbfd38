#!/usr/bin/env bash
# The CUDA path, checked in one prepared run on a lent NVIDIA GPU (one device machine call):
#   1. the knob sweep of benchmarks/cuda_measure.py (attention kernels, precision, recompute,
#      allocator, micro-batch) on Llama-3 8B's layers cut to 4 (benchmarks/recipes/llama3-8b-4l-1gpu.yaml);
#   2. a real `tuner tune` study of that recipe with the model sampler (SQLite), then `tuner plan`
#      on its trials (the fitted prediction beside what was measured);
#   3. one config measured 3 times in a row with `tuner measure` (the spread of a repeat);
#   4. the warm-start helper: whether anything it does initialises CUDA, and a compiled trial and
#      an eager one forked from it (benchmarks/cuda_warm_check.py).
# PHASES picks phases (default "sweep tune repeat warm"), SWEEP_GROUPS the sweep's groups. Each
# phase has its own time limit and a failed phase does not stop the next. Logs and results go to
# $OUT (default ./cuda-check-out). Packages the machine lacks travel as wheels in .whl/, installed
# first where it exists (for the H200 image's Python 3.12: optuna, sqlalchemy, greenlet, alembic,
# mako, colorlog, pydantic, pydantic-core, annotated-types, typing-inspection, typer, click, from
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VERSION).
#
#   bash benchmarks/cuda_check.sh            # on a machine with an NVIDIA GPU
#   PHASES="warm sweep" SWEEP_GROUPS=recompute,compile bash benchmarks/cuda_check.sh
set -u
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
cd "$(dirname "$0")/.."
OUT=${OUT:-cuda-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TUNER_CACHE_DIR=${TUNER_CACHE_DIR:-/tmp/tuner-cache}
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
RECIPE=${RECIPE:-benchmarks/recipes/llama3-8b-4l-1gpu.yaml}
PHASES=${PHASES:-sweep tune repeat warm}
SWEEP_GROUPS=${SWEEP_GROUPS:-attention,precision,recompute,memory}
# The repeat measures the study's baseline (flash attention, bf16 autocast), not the knobs' defaults.
REPEAT_SET=${REPEAT_SET:---set micro_batch_size=8 --set attention=flash --set amp=O1 --set amp_dtype=bf16}
LOG=$OUT/check.log
has() { case " $PHASES " in *" $1 "*) return 0 ;; esac; return 1; }
phase() { echo; echo "=== $1 ($(date +%T))"; }
{
    phase environment
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, optuna, sqlalchemy; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'optuna', optuna.__version__)"

    if has warm; then
        phase "warm-start helper (benchmarks/cuda_warm_check.py)"
        timeout 150 python3 benchmarks/cuda_warm_check.py
        echo "exit $?"
    fi

    if has sweep; then
        phase "knob sweep (benchmarks/cuda_measure.py)"
        timeout 150 python3 benchmarks/cuda_measure.py "$RECIPE" --layers 4 --max-minutes 1.5 \
            --only "$SWEEP_GROUPS" --out "$OUT/cuda_measure.csv"
        echo "exit $?"
    fi

    if has tune; then
        phase "tuner tune (model sampler, SQLite)"
        timeout 200 python3 -m tuner.cli.main tune "$RECIPE" --trials 8 --timeout-min 1.8 --remeasure 2 \
            --storage "sqlite:///$OUT/study.db" --json >"$OUT/tune.json"
        echo "exit $?"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({k: d.get(k) for k in ('best','counts','speedup')}, indent=1)[:3000])" "$OUT/tune.json"

        phase "tuner plan (fitted to the study's trials)"
        timeout 40 python3 -m tuner.cli.main plan "$RECIPE" --top 10 --storage "sqlite:///$OUT/study.db" --json >"$OUT/plan.json"
        echo "exit $?"
        timeout 40 python3 -m tuner.cli.main plan "$RECIPE" --top 10 --storage "sqlite:///$OUT/study.db"
    fi

    if has repeat; then
        phase "tuner measure, 3 times in a row"
        # shellcheck disable=SC2086
        timeout 75 python3 benchmarks/measurement.py repeat "$RECIPE" --times 3 $REPEAT_SET
        echo "exit $?"
    fi
    phase done
} 2>&1 | tee "$LOG"
