#!/usr/bin/env bash
# The first thing to run on a GPU. On ONE GPU (an H200), in one call of under 8 minutes:
# 1. the smoke matrix (benchmarks/gpu_smoke.py): every engine and feature one GPU runs, a few
#    steps each (ZeRO-1/2/3, ZeRO-2 + optimizer offload, ZeRO-3 + offload all, FSDP2 ± offload,
#    train.compile, fp16, flash-attention on packed SFT, LoRA under ZeRO-3 with its exports,
#    QLoRA under DDP and ZeRO-3, activation checkpointing, a resumed checkpoint): pass/fail, the
#    first error line, steps/s and peak memory against the plan's estimate → $OUT/gpu-smoke.json;
# 2. in the time left, the benchmark: a 1.1B Llama (benchmarks/configs/llama-1b.yaml), bf16.
#    Steady-state tokens/s and MFU (of the datasheet dense bf16 peak; the measured matmul rate
#    beside it) of `dplaunch train` as DDP-1, as ZeRO-2, and with activation checkpointing, the
#    hand-written Accelerate loop on the same run (the ceiling), and each dplaunch run's peak
#    memory against the plan's estimate (planning/estimate.py).
# Results: $OUT/gpu-smoke.json, gpu.json, gpu.png, gpu.txt (device, versions),
# matmul_peak.json, runs.log (every run's output). `bash benchmarks/gpu.sh smoke`: the matrix only.
# Budget: one call, under 8 minutes (BUDGET_S from the start; the matrix gets SMOKE_BUDGET_S of
# it, each benchmark run is cut at RUN_LIMIT_S or what is left).
#
# 1. Here (a machine with PyPI), once, from `make install`'s venv or `make test`'s: the packages
#    the GPU image lacks or holds below dplaunch's floors (transformers 5.17 there), as wheels in
#    .whl/ (git-ignored): transformers, DeepSpeed built from its sdist (pure Python; its ops
#    JIT-build when needed, and ZeRO-2 with torch's AdamW needs none), pydantic, datasets, peft,
#    bitsandbytes and their whole dependency closure (benchmarks/gpu_wheels.py reads it from the
#    installed packages' metadata, or a downloaded wheel's for a root not installed here). It
#    fails when .whl/ and the working tree together exceed a call's 64 MiB.
#        bash benchmarks/gpu.sh prepare
# 2. On the device, one call (the tool `run`, carry [".whl"], timeout_s 540):
#        bash benchmarks/gpu.sh
#    then copy the returned gpu.json and gpu.png into benchmarks/results/.
# A smoke test of the script itself on a machine without a GPU (numbers meaningless):
#        PY=.venv/bin/python CONFIG=benchmarks/configs/llama-3m.yaml OUT=/tmp/gpu-smoke \
#            EXTRA="--cpu --max-steps 15 --set train.log_every=5" RUN_LIMIT_S=400 \
#            SMOKE_FLAGS="--cpu --only resume" bash benchmarks/gpu.sh
# (the smoke matrix alone on CPU ranks: python -m benchmarks.gpu_smoke WORK OUT --cpu)
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "prepare" ]]; then
    PY=${PY:-.venv/bin/python}
    mkdir -p .whl
    rm -f .whl/*.whl
    # the device runs CPython 3.12 on x86-64 manylinux
    download() {
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl -r "$1"
    }
    # what the benchmark imports beyond the image's torch and accelerate, and dplaunch's floors
    # the image may miss, at the versions installed here (constraints.txt): benchmarks/gpu_wheels.py
    "$PY" -m benchmarks.gpu_wheels roots > .whl/roots.txt
    # the roots this venv lacks (`make install`'s: bitsandbytes) first: pins reads their wheels
    "$PY" -m benchmarks.gpu_wheels absent > .whl/absent.txt
    if [[ -s .whl/absent.txt ]]; then
        download .whl/absent.txt
    fi
    "$PY" -m benchmarks.gpu_wheels pins > .whl/pins.txt
    "$PY" -m pip wheel --quiet --no-deps "$(grep '^deepspeed==' .whl/roots.txt)" -w .whl
    download .whl/pins.txt
    # what the device never loads left out: bitsandbytes for other CUDA versions (43 → 3.5 MB),
    # pyarrow's Flight, S3, headers, tests and link-time copies (55 → 33 MB), transformers'
    # modular_ and convert_ sources (13 → 11 MB)
    for wheel in .whl/bitsandbytes-*.whl .whl/pyarrow-*.whl .whl/transformers-*.whl; do
        "$PY" -m benchmarks.gpu_wheels slim "$wheel"
    done
    ls -la .whl
    # a call carries the working tree and .whl/: 64 MiB in all
    carry=$(du -sb .whl | cut -f1)
    tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null \
        | tail -1 | cut -f1)
    echo "the carry: .whl/ $(( carry >> 20 )) MiB + the working tree $(( tree >> 20 )) MiB" \
        "= $(( (carry + tree) >> 20 )) MiB of a call's 64"
    if (( carry + tree > 64 << 20 )); then
        echo "gpu.sh prepare: over a call's 64 MiB: slim or leave out a wheel (benchmarks/gpu_wheels.py)"
        exit 1
    fi
    exit 0
fi

PY=${PY:-python3}  # on the device, the python3 that has PyTorch
OUT=${OUT:-benchmarks/results/gpu-run}
WORK=${WORK:-/tmp/dplaunch-gpu-bench}
CONFIG=${CONFIG:-benchmarks/configs/llama-1b.yaml}
# extra flags for every run (the smoke test's --cpu)
read -r -a EXTRA_FLAGS <<< "${EXTRA:-}"
# flags of the smoke matrix (gpu_smoke.py: --cpu, --only NAME,…)
read -r -a SMOKE_ARGS <<< "${SMOKE_FLAGS:-}"
RUN_LIMIT_S=${RUN_LIMIT_S:-150}
# seconds from here (the wheels' install and the matmul probe included)
BUDGET_S=${BUDGET_S:-460}
SMOKE_BUDGET_S=${SMOKE_BUDGET_S:-400}
SECONDS=0
mkdir -p "$OUT" "$WORK"
rm -rf "${WORK:?}"/*

# the carried wheels: the device's pip resolves roots.txt against the image (a dry run writes
# nothing) and only the wheels it finds missing, or below what roots.txt asks, are installed:
# the image's own packages that do are not shadowed by others
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install --dry-run --quiet --no-index --find-links .whl --report /tmp/wheels.json \
        -r .whl/roots.txt
    mapfile -t NEEDED < <("$PY" -c 'import json, sys, urllib.parse as u
for item in json.load(open(sys.argv[1]))["install"]:
    print(u.unquote(u.urlparse(item["download_info"]["url"]).path))' /tmp/wheels.json)
    echo "installing ${#NEEDED[@]} carried wheels the image lacks: ${NEEDED[*]##*/}"
    if (( ${#NEEDED[@]} )); then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target /tmp/site "${NEEDED[@]}"
    fi
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no GPU"; } \
    | tee "$OUT/gpu.txt"
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
    | tee -a "$OUT/gpu.txt"
# dplaunch's floors (resources/requirements.txt) on this python, the carry installed: one line,
# the versions or what is missing. A miss stops here: every run would end on it
if ! "$PY" -m benchmarks.gpu_wheels floors | tee -a "$OUT/gpu.txt"; then
    echo "== stopped before the smoke matrix: carry what is missing (bash benchmarks/gpu.sh prepare)"
    exit 1
fi
# the measured dense bf16 matmul rate, reported beside the datasheet peak (GPU only)
"$PY" - "$OUT/matmul_peak.json" <<'EOF'
import json, sys, torch
if torch.cuda.is_available():
    n, repeats = 8192, 10
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    flops = 2 * n**3 * repeats / (start.elapsed_time(end) / 1000)
    json.dump({"matmul_bf16_flops": flops, "shape": [n, n, n]}, open(sys.argv[1], "w"))
    print(f"measured dense bf16 matmul: {flops / 1e12:.0f} TFLOP/s")
EOF

if (( SMOKE_BUDGET_S > BUDGET_S - SECONDS )); then
    SMOKE_BUDGET_S=$(( BUDGET_S - SECONDS ))
fi
echo "== the smoke matrix (benchmarks/gpu_smoke.py, at most ${SMOKE_BUDGET_S} s)"
"$PY" -m benchmarks.gpu_smoke "$WORK/smoke" "$OUT" --budget-s "$SMOKE_BUDGET_S" \
    ${SMOKE_ARGS[@]+"${SMOKE_ARGS[@]}"} || echo "   the smoke matrix has failures: $OUT/gpu-smoke.json"
if [[ "${1:-}" == "smoke" ]]; then
    exit 0
fi

# the benchmark's four runs share what the matrix left of the call
left=$(( BUDGET_S - SECONDS ))
if (( left / 4 < RUN_LIMIT_S )); then
    RUN_LIMIT_S=$(( left / 4 ))
fi
if (( RUN_LIMIT_S < 40 )); then
    echo "== no time left for the benchmark runs (${SECONDS} s spent)"
    exit 0
fi

# one dplaunch run: NAME, then flags; a failing run is logged and the others still run
train() {
    local name=$1
    shift
    echo "== dplaunch train $name: $*"
    echo "== dplaunch train $name: $*" >> "$OUT/runs.log"
    timeout "$RUN_LIMIT_S" "$PY" -m dplaunch train "$CONFIG" --gpus 1 -o "$WORK/$name" \
        ${EXTRA_FLAGS[@]+"${EXTRA_FLAGS[@]}"} "$@" \
        > "$WORK/$name.log" 2>&1 || echo "   $name failed (status $?)"
    cat "$WORK/$name.log" >> "$OUT/runs.log"
    grep -E "^step |rank\(s\)|[Ee]rror" "$WORK/$name.log" | tail -4 || true
}

train ddp1
train zero2 --zero 2
train ddp1-checkpointing --set model.gradient_checkpointing=true

echo "== hand-written Accelerate loop, DDP-1 (the ceiling)" | tee -a "$OUT/runs.log"
{
    "$PY" -m dplaunch config "$CONFIG" --gpus 1 ${EXTRA_FLAGS[@]+"${EXTRA_FLAGS[@]}"} --out "$WORK/hand"
    "$PY" -m benchmarks.contenders.prepare_blocks "$WORK/hand" "$WORK/blocks.pt"
    timeout "$RUN_LIMIT_S" "$PY" -m accelerate.commands.launch \
        --config_file "$WORK/hand/accelerate.yaml" -m benchmarks.contenders.hand_loop \
        "$WORK/hand" "$WORK/blocks.pt" "$WORK/hand/times.jsonl"
} >> "$OUT/runs.log" 2>&1 || echo "   hand loop failed (status $?)"
echo "runs took ${SECONDS} s"

"$PY" -m benchmarks.gpu_report "$WORK" "$OUT"
