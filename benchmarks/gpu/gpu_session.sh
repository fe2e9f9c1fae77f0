#!/usr/bin/env bash
# One GPU call, stage by stage: each stage in its own time box, its output written to $OUT as it finishes,
# so a call cut off at its limit still returns what the stages before measured. Run from the repository
# root through the offline bundle (docs/offline_bundle.md), Multi30k carried beside it:
#   .bundle/run.sh 'MULTI30K_DIR=.m30k benchmarks/gpu/gpu_session.sh env,decode,recipe,tests,profile'
# Stages (in the order given):
#   env      the GPU, driver, torch; whether a cuBLAS 12 is there (CTranslate2's CUDA wheels need one)
#   train    bench_gpu.py's training step at the WMT-base shape, eager, as is and with
#            model.low_precision_residual (TRAIN_MODELS: the competitors)
#   decode   bench_gpu.py's decoding: ours eager, the graphed step, transformers generate (CTranslate2 if
#            importable), batches of 64 and 256, beam 4 and greedy, first-call cost and same-token share
#   recipe   `python train.py experiment=multi30k_de_en trainer=gpu` end to end, timed from start to last
#            line, with Lightning's simple profiler (where the time went) and the run's metrics
#            (RECIPE_ARGS: more overrides, e.g. model.low_precision_residual=true)
#   tests    pytest -m gpu (PYTEST_K: only the tests pytest's -k selects)
#   profile  gpu_profile.py, our eager training step at the WMT-base shape (kernels, top operators)
# Files in $OUT (at most 8 come back from a lent machine): stages.txt (one line a stage: exit status,
# seconds, box), then one <stage>.txt each, recipe_profile.txt and recipe_metrics.csv.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_session}
MULTI30K_DIR=${MULTI30K_DIR:-.m30k}
export WANDB_MODE=offline HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"

stage() {  # stage NAME BOX_SECONDS COMMAND...: COMMAND's output into $OUT/NAME.txt, its line into stages.txt
    local name=$1 box=$2 start rc
    shift 2
    start=$(date +%s)
    timeout --kill-after 10 "$box" "$@" >"$OUT/$name.txt" 2>&1
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - start)) s (box $box s)" | tee -a "$OUT/stages.txt"
}

env_report() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python -c 'import torch, lightning, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "lightning", lightning.__version__, "transformers", transformers.__version__)'
    python -c 'import torch.nn.functional as F; print("F.linear_cross_entropy", hasattr(F, "linear_cross_entropy"))'
    python -c 'import ctranslate2; print("ctranslate2", ctranslate2.__version__, "CUDA devices", ctranslate2.get_cuda_device_count())' 2>&1 | tail -1
    echo "cuBLAS libraries:"
    ldconfig -p | grep -E 'libcublas\.so' || true
    timeout 20 find / -xdev -name 'libcublas.so.1*' -not -path '/proc/*' 2>/dev/null | head -20
}

recipe() {
    local run=/tmp/recipe_run
    rm -rf "$run"
    python train.py experiment=multi30k_de_en trainer=gpu data.data_dir="$MULTI30K_DIR" hydra.run.dir="$run" \
        +trainer.profiler._target_=lightning.pytorch.profilers.SimpleProfiler \
        +trainer.profiler.dirpath="$run" +trainer.profiler.filename=profile ${RECIPE_ARGS:-}
    local rc=$?
    cp "$run/fit-profile.txt" "$OUT/recipe_profile.txt" 2>/dev/null
    find "$run/csv" -name metrics.csv -exec cp {} "$OUT/recipe_metrics.csv" \; 2>/dev/null
    return $rc
}

IFS=, read -r -a stages <<<"${1:-env,decode,recipe,tests,profile}"
for name in "${stages[@]}"; do
    case $name in env | train | decode | recipe | tests | profile) ;;
    *) echo "error: unknown stage '$name' (expected some of env,train,decode,recipe,tests,profile)" >&2 && exit 2 ;;
    esac
done
for name in "${stages[@]}"; do
    case $name in
    env) stage env 60 bash -c "$(declare -f env_report); env_report" ;;
    train)
        stage train 150 python -m benchmarks.gpu.bench_gpu --skip decode --models "${TRAIN_MODELS:-ours,ours:lowprecisionresidual}" \
            --budget-s 130 --results-dir /tmp
        ;;
    decode)
        stage decode 170 python -m benchmarks.gpu.bench_gpu --skip train --decode-methods ours,generate,graphed,ctranslate2 \
            --budget-s 150 --results-dir /tmp
        ;;
    recipe) stage recipe 360 bash -c "$(declare -f recipe); OUT=$OUT MULTI30K_DIR=$MULTI30K_DIR RECIPE_ARGS='${RECIPE_ARGS:-}' recipe" ;;
    tests) stage tests 150 python -m pytest -m gpu -q -p no:cacheprovider -rA ${PYTEST_K:+-k "$PYTEST_K"} ;;
    profile) stage profile 90 python -m benchmarks.gpu.gpu_profile --models ours ;;
    esac
done
