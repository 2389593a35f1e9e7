set -u
out=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/new .whl/*.whl || exit 1
mkdir -p /tmp/run; cp -r tests bench examples pyproject.toml /tmp/run/; cd /tmp/run
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/new
timeout 45 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_trainer.py tests/test_mnist_example.py tests/test_cluster_launch.py 2>&1 | tail -4
timeout 85 python3 bench/ps_throughput.py --striping --quick 2>&1 | tee $out/ps_striping.log | tail -22
timeout 75 python3 bench/gpu_step.py --only mlp-fp16,mlp-onebit,mlp-topk,mlp-bytegrad,gpt2-onebit --steps 5 --warmup 2 --json $out/gpu_step.json 2>&1 | grep -A9 "^| configuration"
cp bench/results/ps_striping.json $out/ 2>/dev/null; true
