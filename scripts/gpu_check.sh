#!/usr/bin/env bash
# Every GPU check of helios.cuda_ptx in one command, for a machine with an NVIDIA GPU:
#
#   ./scripts/gpu_check.sh [RESULTS_DIR] [all|tests|bench|device|attention|coopmat|coopmat-ops|coopmat-train]
#   (defaults: ./gpu-results, all)
#
# "tests" runs steps 1-3, "bench" steps 2, 4 and 5 (the smoke run decides what is left
# out of the benchmark), "device" step 6 alone, "attention" step 7 alone (under 8 minutes),
# so the whole can be split over shorter sessions.  "coopmat" is the Vulkan part, on its own
# (not in "all"): matmul on cooperative matrices (VK_KHR_cooperative_matrix) through the GPU's
# Vulkan driver; "coopmat-ops" is its first half (the facts, the op tests, the GEMM and attention
# benchmarks), "coopmat-train" its second (the facts, then the training-step benchmarks), for
# sessions whose calls are shorter than the whole (the second appends to the first's logs).
# It runs with $PYTHON's helios where that has its Vulkan addon (built by
# ./scripts/setup.sh --test), else with one it installs into a temporary folder with the addon
# built there (a C++ compiler, pybind11 importable by $PYTHON, the Vulkan headers and loader;
# VULKAN_SDK names an SDK's include/ and lib/, or the usr/ of Debian's libvulkan1 and
# libvulkan-dev unpacked into a folder; the log is coopmat_build.log), the GPU's Vulkan driver
# (VK_DRIVER_FILES names its ICD json where the loader does not find it) and the SPIR-V of
# kernels_spirv/spv as it is (the coopmat kernels need glslang 13 or newer to build, so bring
# them built; HELIOS_GPU_BUILD_ADDON=1 builds even where $PYTHON's has one): first the device's
# facts (RESULTS_DIR/coopmat_env.json; exit 2 where the device lists no cooperative matrices),
# then correctness against PyTorch (tests/test_coopmat_gpu.py, test_coopmat_select.py,
# test_coopmat_kernel.py, test_mixed_matmul.py for autocast's casts in the shared-memory and
# cooperative-matrix kernels, test_flash_coop.py for fp16 and bf16 flash attention on
# cooperative matrices, test_rotary.py for the rotary kernel's bits on a GPU's compiler ->
# coopmat_tests.log), then speed (bench/vulkan_coopmat.py at 4096^3, nn
# nt tn, fp16 and bf16 where listed: coopmat, the shared-memory kernel and cuBLAS in the same
# dtype; then its fp16 and bf16 attention at T 1024 and 4096, head dims 64 and 128: flash_coop,
# the shared-memory flash kernel and PyTorch's CUDA SDPA; bench/autocast_step.py: helios-train
# --dtype bf16 against fp32 at tiny, small and gpt2; bench/attention.py in bf16 at T 64 ...
# 512: flash against the autocast dense path, for where training should switch to flash
# (FLASH_MIN_TRAIN_T); last, bench/train_step.py's GPT-2 124M bf16 step (GPT-2's 50,257-token
# vocabulary, its tied head) on vulkan:0 against PyTorch CUDA eager under autocast on the same
# GPU -> coopmat_bench.log, coopmat.jsonl).
#
# It downloads nothing: the machine needs its driver, ptxas (the CUDA toolkit or the
# nvidia-cuda-nvcc wheel), and a Python ($PYTHON, default python3) with numpy,
# cuda-bindings, pytest, setuptools and a CUDA build of torch (the cuBLAS
# peer).  The package is installed without its native Vulkan parts into a temporary
# folder, so neither Vulkan nor glslc is needed.
#
# Steps, each run even when an earlier one failed (exit status 0: all passed, 1: a step failed,
# 2: no usable CUDA driver, so only the gate ran):
#   1. the no-GPU gate with this machine's ptxas (python -m helios.cuda_ptx.gate);
#   2. a smoke run: each variant and B layout once, small, 60 s deadline
#      (python -m helios.cuda_ptx.smoke); pairs that hang are left out of what follows;
#   3. numerics of every variant on the GPU (pytest -m gpu tests/test_cuda_ptx_driver.py);
#   4. bench/ptx_gemm.py at 4096 and 8192, B K-major, then N-major, one process per variant
#      so that a kernel that hangs at size costs only its own line;
#   5. the A/B of the pipeline choices: inflight=0 group_m=0 on the wgmma rungs at 8192, and
#      wgmma_persistent with st.global instead of TMA stores (tma_store=0) at 4096 and 8192
#      (wgmma_cluster against wgmma_persistent is the A/B of cluster multicast: step 4), and
#      fp8 made persistent with TMA stores and clusters at 4096 and 8192;
#   6. the CUDA device for tensors (cuda:0: the Vulkan kernels translated to PTX): the op suite
#      with cuda:0 as the device, the tiny GPT for 200 steps on cuda:0, and its training step
#      against PyTorch CUDA eager (bench/train_step.py --device cuda:0 --peer cuda); replays as
#      CUDA graphs (HELIOS_CUDA_GRAPHS=1: tests/test_graph.py's replays, then the small config's
#      bf16 step with --cuda-graphs-ab: graphs_over_launches is the A/B).  It needs the
#      SPIR-V kernels built (kernels_spirv/spv, or glslc on the machine);
#   7. flash attention on cuda:0's tensor cores (flash_wgmma_fwd / flash_wgmma_bwd), each part
#      bounded by its own timeout, cut to what is left of HELIOS_GPU_ATTN_BUDGET seconds (450) for
#      the whole step (a part that finds under 30 s left is not run, and counts as failed):
#      a. its numerics on the GPU (pytest -m gpu tests/test_cuda_flash.py), 150 s;
#      b. bench/attention.py --device cuda:0 in bf16 against PyTorch's flash SDPA, T = 1024 ... 16384,
#         causal and not, one process per head dim (64, 128), 150 s each; a result off the peer's
#         beyond its --tol, or one not run by the tensor-core kernels (--require-wgmma), fails it;
#      c. GPT-2's training step, bf16, against PyTorch CUDA eager (SDPA, autocast) and torch.compile
#         (bench/train_step.py --device cuda:0 --peer cuda --config gpt2 --dtype bf16), its replays
#         also as CUDA graphs (--cuda-graphs-ab), and one profiled step's 20 kernels of the most
#         device time (--kernels 20) and its every dispatch (gpt2_dispatches.tsv), 180 s;
#      d. helios-train --device cuda:0 --config gpt2 --dtype bf16 --steps 200, its losses next to a
#         PyTorch twin's from the same initial weights and batches (bench/train_parity.py), 240 s;
#         then the step's four weight-gradient products against cuBLAS (bench/matmul.py --shapes), 60 s;
#      e. autocast's tensor-core products on the GPU (pytest -m gpu -k autocast
#         tests/test_cuda_tensor_cores.py: gradients stored rounded by round_out, bit for bit the
#         separate casts), 60 s.
# RESULTS_DIR gets env.txt, gate.log, smoke.jsonl, gpu_tests.log, bench.log, ptx_gemm.jsonl,
# cuda_device.log, cuda_train.log and train_step.jsonl; step 7 flash_tests.log,
# attention_bench.log, attention.jsonl, gpt2.log, gpt2_train_step.jsonl, gpt2_dispatches.tsv,
# train_parity.jsonl and gpt2_parity/ (helios-train's run folder, both loss curves in curves.json).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$repo/gpu-results}" && cd "${1:-$repo/gpu-results}" && pwd)
part=${2:-all}
case $part in all|tests|bench|device|attention|coopmat|coopmat-ops|coopmat-train) ;; *) echo "gpu_check: the second argument is one of all, tests, bench, device, attention, coopmat, coopmat-ops, coopmat-train; not '$part'" >&2; exit 1 ;; esac
py=${PYTHON:-python3}
bench_timeout=${HELIOS_GPU_BENCH_TIMEOUT:-240}
attn_budget=${HELIOS_GPU_ATTN_BUDGET:-450}
[ -d /usr/local/cuda/bin ] && export PATH=$PATH:/usr/local/cuda/bin
failed=()

step() {  # step NAME LOG CMD...: run CMD, tee its output to LOG, remember a failure
    local name=$1 log=$2
    shift 2
    echo "== $name"
    if ! "$@" 2>&1 | tee -a "$log"; then
        failed+=("$name")
    fi
}

coopmat_helios() {  # a helios with its Vulkan addon for the coopmat part: $py's, or one installed here
    local lib d sdk_libs=""
    if [ "${HELIOS_GPU_BUILD_ADDON:-0}" != 1 ] && (cd / && "$py" -c "import helios._vulkan") 2>/dev/null; then
        cd "$repo" || return 1
        return 0
    fi
    if ! "$py" -c "import pybind11" 2>/dev/null; then
        echo "gpu_check: $py has no helios with its Vulkan addon, and no pybind11 to build one (put it on PYTHONPATH)" >&2
        return 1
    fi
    coop_site=$(mktemp -d)
    trap 'rm -rf "$coop_site"' EXIT
    lib=$coop_site/lib
    # VULKAN_SDK's libraries: an SDK's lib/, or a Debian tree's lib/<multiarch>/ (libvulkan1 and
    # libvulkan-dev unpacked into a folder with dpkg -x: VULKAN_SDK=<folder>/usr)
    for d in "${VULKAN_SDK:-/nonexistent}/lib" "${VULKAN_SDK:-/nonexistent}"/lib/*-linux-gnu; do
        [ -d "$d" ] && sdk_libs=${sdk_libs:+$sdk_libs:}$d
    done
    echo "gpu_check: building helios with its Vulkan addon into $lib (log: $out/coopmat_build.log)"
    if ! CPPFLAGS="${VULKAN_SDK:+-I$VULKAN_SDK/include }${CPPFLAGS:-}" LDFLAGS="${sdk_libs:+-L${sdk_libs//:/ -L} }${LDFLAGS:-}" \
            HELIOS_SKIP_KERNEL_BUILD=1 "$py" -m pip install -q --no-deps --no-build-isolation --no-index \
            --target "$lib" "$repo" >"$out/coopmat_build.log" 2>&1; then
        tail -n 20 "$out/coopmat_build.log"
        echo "gpu_check: building the Vulkan addon failed (see above: a compiler, pybind11, the Vulkan headers and loader)" >&2
        return 1
    fi
    export PYTHONPATH=$lib${PYTHONPATH:+:$PYTHONPATH}
    export LD_LIBRARY_PATH=${sdk_libs:+$sdk_libs:}${LD_LIBRARY_PATH:-}
    cd "$lib" || return 1  # not the checkout: its root on sys.path would shadow the installed package
}

coopmat() {  # the "coopmat" part, or one of its halves (see the top)
    local facts rc=0
    coopmat_helios || return 1
    if [ "$part" != coopmat-train ]; then
        : >"$out/coopmat_tests.log"
        : >"$out/coopmat_bench.log"
    fi
    facts=$("$py" -c "import json
from helios._kernels import coopmat
from helios.runtime import get_runtime
rt = get_runtime()
shapes = coopmat.shapes_of(getattr(rt, 'info', None) or {})
chs = {dt: coopmat.choice_for(rt, dt, 4096, 4096, 4096) for dt in ('float16', 'bfloat16')}
print(json.dumps({'device': rt.name, 'name': rt.info.get('name'), 'shapes': [s.label() for s in shapes],
                  **{dt: {'kernel': ch.kernel, 'tile': ch.tile.label() if ch.tile else None, 'reason': ch.reason}
                     for dt, ch in chs.items()}}))
raise SystemExit(0 if shapes else 3)") || rc=$?
    echo "$facts" | tee "$out/coopmat_env.json"
    if [ "$rc" -ne 0 ]; then
        [ "$rc" -eq 3 ] && echo "gpu_check: the device lists no cooperative matrices: nothing to check" >&2
        [ "$rc" -ne 3 ] && echo "gpu_check: helios with its Vulkan addon does not run here (PYTHON=$py; see above)" >&2
        return 2
    fi
    [ "$part" != coopmat-train ] && coopmat_ops
    [ "$part" != coopmat-ops ] && coopmat_train
    grep '^{' "$out/coopmat_bench.log" >"$out/coopmat.jsonl" || true
    [ ${#failed[@]} -ne 0 ] && { echo "gpu_check: failed: ${failed[*]}" >&2; return 1; }
    echo "gpu_check: the cooperative-matrix part ($part) passed; bench lines in $out/coopmat.jsonl"
}

coopmat_ops() {  # the first half of the coopmat part: op tests, then the GEMM and attention benchmarks
    step coopmat-tests "$out/coopmat_tests.log" "$py" -m pytest -q -p no:cacheprovider "$repo/tests/test_coopmat_gpu.py" \
        "$repo/tests/test_coopmat_select.py" "$repo/tests/test_coopmat_kernel.py" "$repo/tests/test_mixed_matmul.py" \
        "$repo/tests/test_flash_coop.py" "$repo/tests/test_rotary.py"
    step coopmat-bench "$out/coopmat_bench.log" timeout "$bench_timeout" "$py" -u "$repo/bench/vulkan_coopmat.py" --sizes 4096 \
        --layouts nn nt tn --attn-T
    step flash-coop-bench "$out/coopmat_bench.log" timeout "$bench_timeout" "$py" -u "$repo/bench/vulkan_coopmat.py" --sizes \
        --attn-T 1024 4096 --attn-head-dims 64 128 --rounds 3
}

coopmat_train() {  # the second half: training steps, bf16 against fp32 and against PyTorch
    step autocast-bench "$out/coopmat_bench.log" timeout "$bench_timeout" "$py" -u "$repo/bench/autocast_step.py" \
        --device vulkan:0 --configs tiny small gpt2 --rounds 1 --steps 12
    step flash-vs-dense-bench "$out/coopmat_bench.log" timeout "$bench_timeout" "$py" -u "$repo/bench/attention.py" \
        --device vulkan:0 --dtype bf16 --T 64 128 256 512 --head-dim 32 64 --batch 16 --rounds 3 --no-memory
    step gpt2-vs-torch-bench "$out/coopmat_bench.log" timeout "$bench_timeout" "$py" -u "$repo/bench/train_step.py" \
        --device vulkan:0 --peer cuda --dtype bf16 --config gpt2 --vocab 50257 --steps 3 --warmup 1 --no-compile
}
if [ "${part%%-*}" = coopmat ]; then
    coopmat
    exit $?
fi

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if ! HELIOS_NO_NATIVE=1 "$py" -m pip install -q --no-deps --no-build-isolation --no-index \
        --target "$site/lib" "$repo" >"$out/install.log" 2>&1; then
    cat "$out/install.log"
    echo "gpu_check: installing the package failed (see above)" >&2
    exit 1
fi
rm -f "$out/install.log"
export PYTHONPATH=$site/lib${PYTHONPATH:+:$PYTHONPATH}
# Run from outside the checkout: its root on sys.path would shadow the installed package.
cd "$site"

{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi -L 2>&1 || echo "nvidia-smi: not found"
    nvidia-smi --query-gpu=driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1 || true
    "$py" -c "from helios.cuda_ptx import toolchain as t; print('ptxas', t.require_tool('ptxas'), t.ptxas_version())" 2>&1
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>&1
} | tee "$out/env.txt"

# A rerun into the same folder starts afresh every log this part appends to (a stale "hang"
# line in smoke.jsonl would otherwise leave a kernel out of the run).
[ "$part" = all ] || [ "$part" = tests ] && : >"$out/gate.log" && : >"$out/gpu_tests.log"
: >"$out/smoke.jsonl"
[ "$part" = all ] || [ "$part" = bench ] && : >"$out/bench.log"
: >"$out/cuda_device.log"
[ "$part" = all ] || [ "$part" = attention ] && : >"$out/flash_tests.log" && : >"$out/attention_bench.log" && : >"$out/gpt2.log"

cuda_device() {  # step 6
    step cuda-device-ops "$out/cuda_device.log" env HELIOS_DEVICE=cuda:0 "$py" -m pytest -q -p no:cacheprovider \
        "$repo/tests/test_ops.py" "$repo/tests/test_autograd.py"
    step cuda-device-train "$out/cuda_device.log" "$py" -m helios.train --device cuda:0 --config tiny --steps 200 \
        --no-progress --out "$out/cuda_train"
    step cuda-device-bench "$out/cuda_device.log" "$py" -u "$repo/bench/train_step.py" --device cuda:0 --peer cuda \
        --config tiny --steps 20 --warmup 5
    # replays as CUDA graphs (cuda_ptx/replay_graphs.py): correct on the GPU, then against prepared launches
    step cuda-graphs-tests "$out/cuda_device.log" env HELIOS_DEVICE=cuda:0 HELIOS_CUDA_GRAPHS=1 "$py" -m pytest -q \
        -p no:cacheprovider "$repo/tests/test_graph.py" -k replay
    step cuda-graphs-ab "$out/cuda_device.log" "$py" -u "$repo/bench/train_step.py" --device cuda:0 --peer cuda \
        --config small --dtype bf16 --steps 10 --warmup 3 --no-compile --cuda-graphs-ab
    grep '^{' "$out/cuda_device.log" >"$out/train_step.jsonl" || true
}

attn_end=0
attn() {  # attn NAME LOG CAP CMD...: a part of step 7 under a timeout of CAP s, cut to what is left of its budget
    local name=$1 log=$2 cap=$3 left=$((attn_end - SECONDS))
    shift 3
    if [ "$left" -lt 30 ]; then
        echo "== $name: not run (${left} s left of the attention step's ${attn_budget})" | tee -a "$log"
        failed+=("$name (no time left)")
        return
    fi
    [ "$left" -lt "$cap" ] && cap=$left
    step "$name" "$log" timeout -k 10 "$cap" "$@"
}

attention() {  # step 7
    local d
    attn_end=$((SECONDS + attn_budget))
    attn flash-tests "$out/flash_tests.log" 150 "$py" -m pytest -q -p no:cacheprovider -m gpu \
        "$repo/tests/test_cuda_flash.py"
    for d in 64 128; do  # causal and not in each
        attn "attention-d$d" "$out/attention_bench.log" 150 "$py" -u "$repo/bench/attention.py" --device cuda:0 \
            --dtype bf16 --head-dim "$d" --T 1024 2048 4096 8192 16384 --rounds 3 --require-wgmma
    done
    grep '^{' "$out/attention_bench.log" >"$out/attention.jsonl" || true
    attn gpt2-train-step "$out/gpt2.log" 180 "$py" -u "$repo/bench/train_step.py" --device cuda:0 --peer cuda \
        --config gpt2 --dtype bf16 --kernels 20 --cuda-graphs-ab --dispatches "$out/gpt2_dispatches.tsv"
    attn gpt2-train-parity "$out/gpt2.log" 240 "$py" -u "$repo/bench/train_parity.py" --device cuda:0 --peer cuda \
        --config gpt2 --dtype bf16 --steps 200 --out "$out/gpt2_parity"
    # the step's weight-gradient products (small outputs over 8,192 tokens: the GEMM's weakest shapes)
    attn gpt2-weight-grads "$out/gpt2.log" 60 env HELIOS_DEVICE=cuda:0 "$py" -u "$repo/bench/matmul.py" --sizes \
        --gpt 0 0 0 --shapes 768x8192x2304 768x8192x768 3072x8192x768 768x8192x3072 --layouts tn --dtype bfloat16 \
        --rounds 3 --no-numpy --cuda-peer
    grep '^{"bench": "train_step' "$out/gpt2.log" >"$out/gpt2_train_step.jsonl" || true
    grep '^{"bench": "train_parity"' "$out/gpt2.log" >"$out/train_parity.jsonl" || true
    # last, where time is left: autocast's products on the GPU (round_out's gradients, bit for bit the casts)
    # (cuda:0 as the device the tests start from: the package here is built without the Vulkan addon)
    attn autocast-products "$out/flash_tests.log" 60 env HELIOS_DEVICE=cuda:0 "$py" -m pytest -q -p no:cacheprovider \
        -m gpu -k autocast "$repo/tests/test_cuda_tensor_cores.py"
}

# HELIOS_GATE_ARGS: extra arguments of the gate (--no-emulate skips its CPU emulation runs)
[ "$part" = all ] || [ "$part" = tests ] && step gate "$out/gate.log" "$py" -m helios.cuda_ptx.gate ${HELIOS_GATE_ARGS:-}
if ! why=$("$py" -c "from helios.cuda_ptx import driver; ok, why = driver.driver_status(); print(why); raise SystemExit(0 if ok else 1)"); then
    echo "gpu_check: no usable CUDA driver ($why): nothing that needs a GPU ran${failed:+; the gate failed}" >&2
    [ ${#failed[@]} -ne 0 ] && exit 1
    exit 2
fi
# Smoke first: a hung kernel is reported once here instead of holding every later
# test and benchmark of its variant for their whole deadlines.
if [ "$part" = device ]; then
    cuda_device
    [ ${#failed[@]} -ne 0 ] && { echo "gpu_check: failed: ${failed[*]}" >&2; exit 1; }
    echo "gpu_check: the CUDA device's op suite, training run and benchmark passed"
    exit 0
fi
if [ "$part" = attention ]; then
    attention
    [ ${#failed[@]} -ne 0 ] && { echo "gpu_check: failed: ${failed[*]}" >&2; exit 1; }
    echo "gpu_check: flash attention's GPU tests, benchmark, GPT-2 step and training parity passed; lines in" \
        "$out/attention.jsonl, $out/gpt2_train_step.jsonl and $out/train_parity.jsonl"
    exit 0
fi
step smoke "$out/smoke.jsonl" "$py" -m helios.cuda_ptx.smoke --timeout 60
HELIOS_GPU_SKIP=$(grep '^{' "$out/smoke.jsonl" | "$py" -c "import json, sys
print(','.join(d['name'] + ':' + d['b_major'] for d in map(json.loads, sys.stdin) if d['status'] == 'hang'))")
export HELIOS_GPU_SKIP
[ -n "$HELIOS_GPU_SKIP" ] && echo "gpu_check: hung in the smoke run, left out below: $HELIOS_GPU_SKIP"

[ "$part" = all ] || [ "$part" = tests ] && step gpu-tests "$out/gpu_tests.log" "$py" -m pytest -q -p no:cacheprovider -m gpu \
    "$repo/tests/test_cuda_ptx_driver.py"
if [ "$part" = tests ]; then
    [ ${#failed[@]} -ne 0 ] && { echo "gpu_check: failed: ${failed[*]}" >&2; exit 1; }
    echo "gpu_check: the gate, smoke run and GPU tests passed"
    exit 0
fi

variants=$("$py" -c "from helios.cuda_ptx import variants; print(' '.join(variants()))")
bench() {  # bench VARIANT B_MAJOR ARGS...: one bench process, unless the pair hung in the smoke run
    local v=$1 bmaj=$2
    shift 2
    case ",$HELIOS_GPU_SKIP," in *",$v:$bmaj,"*) echo "== bench $v $bmaj: skipped (hung in the smoke run)"; return ;; esac
    step "bench-$v-$bmaj${1:+ $*}" "$out/bench.log" timeout "$bench_timeout" "$py" -u "$repo/bench/ptx_gemm.py" \
        --variants "$v" --b-major "$bmaj" "$@"
}
for v in $variants; do
    bench "$v" k --sizes 4096 8192
done
for v in $variants; do
    case $v in wgmma_tma|wgmma_pipe|wgmma_ws|wgmma_persistent|wgmma_cluster) bench "$v" n --sizes 4096 8192 ;; esac
done
for v in wgmma_pipe wgmma_ws wgmma_fp8 wgmma_persistent wgmma_cluster; do
    bench "$v" k --sizes 8192 --set inflight=0 --set group_m=0
done
bench wgmma_persistent k --sizes 4096 8192 --set tma_store=0
bench wgmma_fp8 k --sizes 4096 8192 --set persistent=1 --set tma_store=1 --set cluster=2
grep '^{' "$out/bench.log" >"$out/ptx_gemm.jsonl" || true
if [ "$part" = all ]; then
    cuda_device
    attention
fi

if [ ${#failed[@]} -ne 0 ]; then
    echo "gpu_check: failed: ${failed[*]}" >&2
    exit 1
fi
echo "gpu_check: all steps passed; bench lines in $out/ptx_gemm.jsonl"
