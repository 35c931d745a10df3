#!/usr/bin/env bash
# The GPU test run, as on the H200: every test file with GPU-only tests, the Triton
# interpreter off, the optional libraries' wheels installed from .whl/ when present.
# Run from the repository root on a CUDA machine: `bash benchmarks/gpu_tests.sh [pytest args]`
# (pytest-xdist spreads the files over the cores: `bash benchmarks/gpu_tests.sh -n 4`; with 8
# workers the largest cases ran out of an H100's memory). Stopped by a signal (`timeout`, Ctrl-C),
# it stops pytest's workers too, so no test keeps the GPU busy under a later timing.
set -euo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/qlens-site .whl/*.whl
    export PYTHONPATH="/tmp/qlens-site:${PWD}${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}"
fi
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
set -m
python -m pytest -q -p no:cacheprovider "$@" \
    tests/kernels/test_gpu_kernels.py \
    tests/kernels/test_gpu_bnb_kernels.py \
    tests/kernels/test_gpu_fast_launch.py \
    tests/kernels/test_gpu_grouped_experts.py \
    tests/kernels/test_gpu_moe_decode.py \
    tests/kernels/test_tinygemm_peer.py \
    tests/quant/test_load_packed.py \
    tests/quant/adopt/test_adopt_torchao_int4_gpu.py \
    tests/quant_models/test_host_path_gpu.py \
    tests/quant_models/test_qmodel_gpu.py \
    tests/quant_models/test_compile_gpu.py \
    tests/quant_models/test_load_gpu.py \
    tests/quant_models/test_moe_prefill_gpu.py \
    tests/quant_models/test_split_inputs_gpu.py \
    tests/quant_models/test_shared_expert_hooks_gpu.py \
    tests/models/test_gguf_written_files_gpu.py &
tests=$!  # its own process group (set -m below): pytest and its workers
stop() {
    kill -INT -- "-$tests" 2>/dev/null || true  # pytest reports what ran, workers stop
    sleep 10
    kill -KILL -- "-$tests" 2>/dev/null || true  # whatever still runs
    exit 130
}
trap stop INT TERM
wait "$tests"
