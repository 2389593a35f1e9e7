"""A round of a multi-round compressor larger than a key may be travels in pieces.

PowerSGD's round vectors (P: b*n*r floats, Q: b*m*r) grow with the matrix and the rank,
and a batch of same-shape matrices multiplies them: a tall matrix or a batch goes over
half a message although each of its partitions would not. The engine cuts such a round
into raw float32 keys that each fit; the servers sum them element by element, so the
result is the algorithm's, bit for bit."""

import os
import subprocess
import sys

import pytest

from tests.harness.ps_job import BPSLAUNCH

# 64 kB messages: a key may carry 32,736 bytes
SMALL_MESSAGES = {"BPS_MAX_MESSAGE_BYTES": "65536", "BYTEPS_PARTITION_BYTES": "16384",
                  "BPS_TIMEOUT": "30", "PYTHONUNBUFFERED": "1"}

ENGINE_JOB = """
import torch
import bps
from bps.compressors import validate_compression_params
from bps.compressors.powersgd import PowerSGD
bps.init()
engine = bps.core.runtime.get().engine
shape = [1200, 1100]  # rank 8: P is 38,400 bytes, Q 35,200: two pieces each
params = validate_compression_params({"compressor": "powersgd", "rank": 8, "ef": "vanilla",
                                      "seed": 5, "shape": shape})
numel = shape[0] * shape[1]
engine.declare(0, numel, torch.float32, params, name="matrix")
x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
got = engine.push_pull(0, x.clone(), 0, 0.1).result(60)
alone = PowerSGD(numel, shape=shape, rank=8, ef=True, seed=5)
alone.set_workers(2)
p = alone.compress(x.clone()).view(torch.float32) * 2  # both workers pushed x
q = alone.compress_round(1, p).view(torch.float32) * 2
print("SAME" if torch.equal(got, alone.decompress(q)) else "DIFFERENT")
if engine.node_id == 1:  # a marker travels on every piece of round 0
    skipped = engine.push_pull(0, None, 1, 0.1, mark="nonfinite", what="matrix").result(60)
else:
    skipped = engine.push_pull(0, x.clone(), 1, 0.1).result(60)
print("SKIPPED", type(skipped).__name__, getattr(skipped, "reason", None))
bps.shutdown()
"""


def run_job(source: str, workers: int) -> str:
    done = subprocess.run([*BPSLAUNCH, "local", "--workers", str(workers), "--servers", "1",
                           "--", sys.executable, "-c", source], capture_output=True,
                          text=True, timeout=180, env={**os.environ, **SMALL_MESSAGES})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return out


def test_rounds_larger_than_a_key_are_summed_in_pieces_exactly():
    out = run_job(ENGINE_JOB, workers=2)
    assert out.count("SAME") == 2 and "DIFFERENT" not in out, out[-3000:]
    assert out.count("SKIPPED Skipped nonfinite") == 2, out[-3000:]


TRAINER_JOB = """
import torch
import bps
bps.init()
torch.manual_seed(0)
# a tall matrix (P of 36,000 bytes) and 60 matrices of one shape, batched (P of 36,000)
model = torch.nn.Sequential(torch.nn.Linear(20, 9000, bias=False),
                            torch.nn.Linear(9000, 150, bias=False),
                            *[torch.nn.Linear(150, 150, bias=False) for _ in range(60)])
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
trainer = bps.DistributedTrainer(model, optimizer, {
    "compressor": "powersgd", "rank": 1, "ef": "vanilla", "warmup_steps": 1,
    "min_compress_bytes": 0, "batch_tensors_with_same_shape": True})
x = torch.randn(8, 20)
for step in range(3):  # step 0 raw in partitions, then compressed
    trainer.zero_grad()
    model(x).pow(2).mean().backward()
    trainer.step()
print("TRAINED", all(bool(torch.isfinite(p).all()) for p in model.parameters()))
trainer.close()
bps.shutdown()
"""


# test_rounds_larger_than_a_key_are_summed_in_pieces_exactly covers the pieces bit for bit
# on a real cluster, and tests/compressors/test_powersgd.py's
# test_a_powersgd_matrix_larger_than_a_key_travels_as_its_rounds a trainer's matrix
@pytest.mark.slow
def test_a_trainer_with_rounds_larger_than_a_key_trains():
    # Before rounds travelled in pieces, the first compressed step failed: "key ...
    # ('0.weight[0] round 0'): 36000 bytes is larger than a key may be".
    out = run_job(TRAINER_JOB, workers=1)
    assert "TRAINED True" in out, out[-3000:]
