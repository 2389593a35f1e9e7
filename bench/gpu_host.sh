#!/usr/bin/env bash
# Everything that needs a GPU, in one run on a one-GPU host with no network: the `cuda`
# tests, then bench/gpu_step.py and the throughput benchmarks. Run from the repository
# root with the wheels it needs in .whl/ (bps's own: `pip wheel --no-deps -w .whl .`;
# pyzmq 27.3 or later and mlxtend for Python 3.12 where the host lacks them; older pyzmq
# wheels bundle a libsodium that runs CURVE about 15x slower):
#
#     bash bench/gpu_host.sh [all|tests|bench] [OUTDIR]
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
run=/tmp/bps-run
rm -rf "$run"
mkdir -p "$run"
cp -r tests bench examples pyproject.toml "$run"/
cd "$run" || exit 1
nvidia-smi -L
python3 -c "import torch, zmq, bps; print('torch', torch.__version__, 'zmq', zmq.zmq_version(),
    'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
if [ "$what" != bench ]; then
    timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 \
        | tee "$out/cuda_tests.log" | tail -40
fi
if [ "$what" != tests ]; then
    # shellcheck disable=SC2086
    timeout "${STEP_TIMEOUT:-240}" python3 bench/gpu_step.py --json "$out/gpu_step.json" \
        ${GPU_STEP_ARGS:-} 2>&1 | tee "$out/gpu_step.log"
fi
