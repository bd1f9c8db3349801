#!/usr/bin/env bash
# The GPU check, one command on a machine with a CUDA GPU:
#   bash bench/gpu_check.sh
# 1. the Triton / flash-attn kernels and the decode CUDA graphs against their references on the GPU
#    (pytest -m gpu), then non-greedy sampling with every sampling parameter (bench/engine/sampling_check.py,
#    temperature > 0, CUDA graphs on and off), 2. bench/engine/decode_step.py (batch 64 against the weight-bytes / bandwidth floor)
# and 3. bench/engine/engine_throughput.py (the CPU bench's workload) for each attention backend (torch,
# triton, flash_attn when installed), CUDA graphs on and off. Writes bench/results/gpu_check/gpu_check.md,
# naming the GPU, with the raw runs beside it.
# GPU_CHECK_QUICK=1 runs fewer steps and requests (a smoke test of this script).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh test          # .venv with the test extras (Triton); a no-op when current
PY=.venv/bin/python
# flash-attn builds from source where no wheel matches; it is optional here.
$PY -c "import flash_attn" 2>/dev/null || $PY -m pip install -q -e ".[gpu]" --no-build-isolation \
  || echo "gpu_check: flash-attn could not be installed; its rows are skipped" >&2
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')"
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0))")

out=bench/results/gpu_check
rm -rf "$out" && mkdir -p "$out"
steps=50; requests=64
[ "${GPU_CHECK_QUICK:-0}" = 1 ] && steps=5 && requests=8

echo "== kernels and CUDA graphs vs reference on $gpu"
kernels_rc=0
$PY -m pytest -q -p no:cacheprovider -m gpu -rs tests/kernels/test_triton_attention.py tests/engine/test_cuda_graphs.py \
  2>&1 | tee "$out/kernel_tests.txt" || kernels_rc=$?

echo "== sampling at temperature > 0 on $gpu (every sampling parameter, seeded, mixed batch)"
sampling_rc=0
{ $PY bench/engine/sampling_check.py --device cuda && $PY bench/engine/sampling_check.py --device cuda --enforce-eager; } \
  2>&1 | tee "$out/sampling_check.txt" || sampling_rc=$?

backends="torch triton"
$PY -c "import flash_attn" 2>/dev/null && backends="$backends flash_attn"
for b in $backends; do
  for graphs in on off; do
    flag=""; [ $graphs = off ] && flag="--enforce-eager"
    [ $b = torch ] && [ $graphs = on ] && continue        # the torch backend plans on the host: no graphs
    echo "== $b, CUDA graphs $graphs"
    $PY bench/engine/decode_step.py --device cuda --attention-backend $b $flag --steps $steps \
      --out "$out/decode_step.$b.graphs-$graphs"
    $PY bench/engine/engine_throughput.py --device cuda --attention-backend $b $flag --dtypes bfloat16 \
      --num-requests $requests --kv-cache-memory 8GiB --out "$out/engine_throughput.$b.graphs-$graphs"
  done
done

{
  echo "# GPU check: $gpu"
  echo
  echo "\`bash bench/gpu_check.sh\` on $(date -u +%Y-%m-%d), torch $($PY -c 'import torch; print(torch.__version__)')."
  echo "Kernel and CUDA-graph tests (pytest -m gpu): $(tail -n 1 "$out/kernel_tests.txt")"
  echo "Sampling at temperature > 0 (bench/engine/sampling_check.py, graphs on and off): $(grep -c '^ok' "$out/sampling_check.txt") ok, $(grep -c '^FAIL' "$out/sampling_check.txt" || true) failed"
  echo
  echo "## Decode step, batch 64 x 512 context, SmolLM2 bf16 (goal on an H100: within 2x of the weight floor)"
  echo
  $PY bench/engine/decode_step.py --render "$out"
  echo
  echo "## Engine throughput (the CPU bench's workload), Kaiten vs HF on the same GPU"
  echo
  echo "| attention | CUDA graphs | requests | Kaiten tok/s | HF static-16 tok/s | HF single tok/s | c/b | c/a |"
  echo "|---|---|---:|---:|---:|---:|---:|---:|"
  for f in "$out"/engine_throughput.*.json; do
    $PY - "$f" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
run = r["runs"]["bfloat16"]
print(f"| {r['attention_backend']} | {'on' if r['cuda_graphs'] else 'off'} | {run['num_requests']} | "
      f"{run['kaiten']['tokens_per_s']:.0f} | {run['hf_static16']['tokens_per_s']:.0f} | "
      f"{run['hf_single']['tokens_per_s']:.0f} | {run['c_over_b']:.1f} | {run['c_over_a']:.1f} |")
EOF
  done
} > "$out/gpu_check.md"
cat "$out/gpu_check.md"
[ $kernels_rc = 0 ] || exit $kernels_rc
exit $sampling_rc
