set -u
out=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/new .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/old .whlold/bps*.whl .whl/pyzmq*.whl .whl/mlxtend*.whl || exit 1
mkdir -p /tmp/run; cp -r tests bench examples pyproject.toml /tmp/run/; cd /tmp/run
export PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/new timeout 100 python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tail -8
PYTHONPATH=/tmp/old timeout 80 python3 bench/gpu_step.py --only mlp-fp16,mlp-onebit --steps 8 --warmup 2 --json $out/old.json 2>&1 | grep -A9 "^| configuration"
(PYTHONPATH=/tmp/new timeout 100 python3 bench/gpu_step.py --only mlp-fp16,mlp-onebit --steps 20 --warmup 2 --json $out/new.json 2>&1 | grep -A9 "^| configuration") &
for i in $(seq 60); do pid=$(pgrep -f "gpu_step.py --child" | head -1); [ -n "$pid" ] && break; sleep 0.5; done
sleep 12; echo profiling $pid
/tmp/new/bin/py-spy record -p $pid -d 8 -r 200 -f raw -o $out/prof.txt --threads --nonblocking 2>&1 | tail -1
wait
