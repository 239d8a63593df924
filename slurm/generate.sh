#!/usr/bin/env bash
# Regenerate the example batch scripts of this folder (or write them to OUT_DIR):
# 16 GPUs of a Jean-Zay-like cluster as 4 nodes × 4 H100 and as 2 nodes × 8 A100, each as pure
# data parallelism (DDP) and as hybrid parallelism (tensor parallel 4 inside a node × ZeRO-1 data
# parallel across). The scripts name every path relative to the checkout (--relative-paths), so
# they hold no machine's paths: submit them from the checkout's root. The run directories (and
# their logs/, which sbatch needs) are under RUNS (default: runs/, relative to the checkout).
#   [RUNS=DIR] bash slurm/generate.sh [OUT_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
out=$(mkdir -p "${1:-$here}" && cd "${1:-$here}" && pwd)
out=$(realpath --relative-to="$repo" "$out")  # the command line is in each script's header
python=${PYTHON:-$repo/.venv/bin/python}
cd "$repo"
runs=${RUNS:-runs}

# in the job, `python` is the one of the pytorch-gpu module (dplaunch pip-installed into it)
common=(examples/llama-1b.yaml --gpus 16 --time 20:00:00 --python python --relative-paths
    --setup 'export HF_HOME=$WORK/hf HF_HUB_OFFLINE=1')
h100=(--gpus-per-node 4 --cpus-per-gpu 24 --account abc@h100 --constraint h100
    --qos qos_gpu_h100-t3 --module arch/h100 --module pytorch-gpu/py3/2.4.0)
a100=(--gpus-per-node 8 --cpus-per-gpu 8 --account abc@a100 --constraint a100
    --qos qos_gpu_a100-t3 --module cpuarch/amd --module pytorch-gpu/py3/2.4.0)

generate() {  # NAME LAYOUT-FLAGS...
    local name=$1
    shift
    "$python" -m dplaunch slurm "${common[@]}" "$@" --job-name "$name" \
        --output-dir "$runs/$name" --out "$out/$name.sbatch" >/dev/null
}
generate llama-1b-ddp-4x4 "${h100[@]}" --zero 0
generate llama-1b-tp4-4x4 "${h100[@]}" --tp 4 --zero 1
generate llama-1b-ddp-2x8 "${a100[@]}" --zero 0
generate llama-1b-tp4-2x8 "${a100[@]}" --tp 4 --zero 1
echo "wrote $repo/$out/llama-1b-{ddp,tp4}-{4x4,2x8}.sbatch"
