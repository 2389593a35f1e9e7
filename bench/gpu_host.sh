#!/usr/bin/env bash
# Everything that needs a GPU, in one run on a one-GPU host with no network: the `cuda`
# tests, then bench/gpu_step.py and the throughput benchmarks. Run from the repository
# root with the wheels it needs in .whl/ (bps's own: `pip wheel --no-deps -w .whl .`;
# pyzmq 27.3 or later and mlxtend for Python 3.12 where the host lacks them; older pyzmq
# wheels bundle a libsodium that runs CURVE about 15x slower):
#
#     bash bench/gpu_host.sh [all|tests|bench|diagnose|profile|convoy] [OUTDIR]
#
# all: the tests, then the benchmarks (bench/gpu_step.py, then bench/ps_throughput.py
# --striping --quick). diagnose: what sets the compressed steps, in about 3 minutes:
# onebit and fp16 raw with one worker node alone on the GPU (no other process
# time-sliced with it), then onebit with larger partitions (fewer keys, fewer waits),
# then the host's CURVE striping with pinned connections (bench/ps_throughput.py
# --striping --quick, whose last column shows how the server's I/O threads shared it),
# then one server's decode, sum and re-encode of GPT-2 small's share on 1 to 16 engine
# threads (bench/server_throughput.py, about a minute). profile: where one worker node's
# onebit steps hold the GIL (bench/gil_profile.py under py-spy, whose wheel goes in .whl/
# too: `pip download py-spy --no-deps --only-binary=:all: --platform manylinux1_x86_64`),
# with 4 and 32 MB partitions, and GPT-2 small's with 32 MB (whose main thread, not its
# waits, held its step at 3c58fc9), about 3 minutes. convoy: whether the hooks wait for
# the GIL (docs/benchmarks.md, the GIL convoy), about 5 minutes: bench/key_overhead.py
# (--convoy, then the per-key CPU on this host's cores), then GPT-2 small's and the
# MLP's onebit steps with 32 MB partitions at the default switch interval (5 ms) and at
# 0.5 ms (set by a sitecustomize.py on PYTHONPATH), taking turns.
#
# Write the commit beside the wheels (`git rev-parse --short HEAD > .whl/COMMIT`): the copy
# that reaches a lent host has no .git, and the reports name it from there.
#
# The package is installed from its wheel into a folder of its own, and the tests run
# from a copy of tests/ and bench/ without the source tree beside them, so what runs is
# what `pip install` gives a user.
set -u
what=${1:-all}
out=$(realpath -m "${2:-bench/results}")
mkdir -p "$out"
site=/tmp/bps-site
rm -rf "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl \
    || exit 1
export PYTHONPATH=$site PATH=$site/bin:$PATH PYTHONUNBUFFERED=1
if [ -f .whl/COMMIT ]; then
    BPS_BENCH_COMMIT=$(cat .whl/COMMIT)
    export BPS_BENCH_COMMIT
fi
run=/tmp/bps-run
rm -rf "$run"
mkdir -p "$run"
cp -r tests bench examples pyproject.toml "$run"/
cd "$run" || exit 1
nvidia-smi -L
python3 -c "import torch, zmq, bps; print('torch', torch.__version__, 'pyzmq', zmq.__version__,
    'libzmq', zmq.zmq_version(), 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
step() {  # a name for the JSON, then gpu_step's arguments; the table rows to stdout
    local name=$1
    shift
    timeout "${STEP_TIMEOUT:-240}" python3 bench/gpu_step.py --json "$out/$name.json" "$@" 2>&1 \
        | tee "$out/$name.log" | grep "^| \|^NVIDIA\|failed"
}
if [ "$what" = all ] || [ "$what" = tests ]; then
    workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
    # shellcheck disable=SC2086
    timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -m cuda -p no:cacheprovider $workers \
        tests 2>&1 | tee "$out/cuda_tests.log" | tail -40
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
    # shellcheck disable=SC2086
    step gpu_step ${GPU_STEP_ARGS:-}
    timeout "${STRIPING_TIMEOUT:-150}" python3 bench/ps_throughput.py --striping --quick 2>&1 \
        | tee "$out/ps_striping.log" | tail -16
    timeout "${SERVER_TIMEOUT:-90}" python3 bench/server_throughput.py --keys 80 \
        --cases onebit bytegrad --threads 1 4 8 16 --steps 3 \
        --json "$out/server_throughput.json" 2>&1 | tee "$out/server_throughput.log" | tail -12
fi
if [ "$what" = diagnose ]; then
    # shellcheck disable=SC2086
    step one-node --only mlp-fp16,mlp-onebit --workers 1 --steps 5 --warmup 2 ${GPU_STEP_ARGS:-}
    for bytes in 1024000 16384000; do
        # shellcheck disable=SC2086
        BYTEPS_PARTITION_BYTES=$bytes step "partitions-$bytes" --only mlp-onebit --steps 5 \
            --warmup 2 ${GPU_STEP_ARGS:-}
    done
    timeout "${STRIPING_TIMEOUT:-150}" python3 bench/ps_throughput.py --striping --quick 2>&1 \
        | tee "$out/ps_striping.log" | tail -16
    timeout "${SERVER_TIMEOUT:-90}" python3 bench/server_throughput.py --keys 80 \
        --cases onebit bytegrad --threads 1 4 8 16 --steps 3 \
        --json "$out/server_throughput.json" 2>&1 | tee "$out/server_throughput.log" | tail -12
fi
if [ "$what" = profile ]; then
    for run in mlp-onebit:4096000:300 mlp-onebit:33554432:300 gpt2-onebit:33554432:40; do
        IFS=: read -r config bytes steps <<<"$run"
        BYTEPS_PARTITION_BYTES=$bytes timeout "${PROFILE_TIMEOUT:-100}" python3 \
            bench/gil_profile.py --out "$out/gil-$config-$bytes.txt" -- python3 \
            bench/gpu_step.py --only "$config" --workers 1 --steps "$steps" --warmup 3 \
            --json "$out/gil-$config-$bytes.json" 2>&1 | tee "$out/gil-$config-$bytes.log" \
            | grep -v "^\[" | tail -60
    done
fi
if [ "$what" = convoy ]; then
    python3 bench/key_overhead.py --convoy 2>&1 | tee "$out/convoy.log"
    timeout "${KEYS_TIMEOUT:-120}" python3 bench/key_overhead.py --rounds 2 --steps 60 \
        --json "$out/key_overhead.json" 2>&1 | tee "$out/key_overhead.log" | tail -6
    switch=/tmp/bps-switch
    mkdir -p "$switch"
    printf 'import os, sys\nsys.setswitchinterval(float(os.environ["BPS_PROBE_SWITCH"]))\n' \
        >"$switch/sitecustomize.py"
    for interval in 0.005 0.0005 0.005 0.0005; do
        # shellcheck disable=SC2086
        PYTHONPATH=$switch:$PYTHONPATH BPS_PROBE_SWITCH=$interval \
            BYTEPS_PARTITION_BYTES=33554432 step "switch-$interval" \
            --only mlp-onebit,gpt2-onebit --steps 6 --warmup 3 ${GPU_STEP_ARGS:-}
    done
fi
