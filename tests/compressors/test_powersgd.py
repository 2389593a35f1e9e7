"""powersgd's compressor alone: orthogonalisation as PyTorch's hook does it, the two
rounds of several workers against the algorithm written out in torch, its error and
warm start, state, validation and planning. The whole pipeline is compared with
DDP's own hook in tests/frontends/test_ddp_powersgd.py."""

import msgpack
import numpy as np
import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as hook

from bps.compressors import build, state_from_wire, state_to_wire, validate_compression_params
from bps.compressors.powersgd import PowerSGD, orthogonalize, should_compress
from bps.worker.planning import plan_batches, plan_tensor
from tests.harness.ps_job import BPSLAUNCH


@pytest.mark.parametrize("shape", [(1, 30, 1), (1, 30, 2), (3, 20, 2), (2, 17, 4)])
@pytest.mark.parametrize("epsilon", [0.0, 1e-8])
def test_orthogonalize_is_the_hooks(shape, epsilon):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    mine, theirs = x.clone(), x.clone()
    orthogonalize(mine, epsilon)
    hook._orthogonalize(theirs, epsilon)
    assert torch.equal(mine, theirs)


def test_a_zero_column_stays_zero():
    x = torch.zeros(1, 5, 2)
    x[0, :, 1] = torch.arange(5.0)
    orthogonalize(x)
    assert torch.equal(x[0, :, 0], torch.zeros(5)) and not torch.isnan(x).any()
    assert torch.allclose(x[0, :, 1].norm(), torch.tensor(1.0))


def reference_step(ms: list[torch.Tensor], q: torch.Tensor) -> tuple:
    """The algorithm of docs/compression.md for several workers' (b, n, m) matrices."""
    q = q.clone()
    orthogonalize(q)
    p = sum(torch.bmm(m, q) for m in ms)
    orthogonalize(p)
    q = sum(torch.bmm(m.transpose(1, 2), p) for m in ms)
    return torch.bmm(p, q.transpose(1, 2)), q


@pytest.mark.parametrize("shape, rank", [((12, 9), 1), ((12, 9), 2), ((3, 8, 8), 3)])
@pytest.mark.parametrize("warm_start", [True, False])
def test_rounds_of_three_workers_match_the_algorithm(shape, rank, warm_start):
    numel = int(np.prod(shape))
    workers = [PowerSGD(numel, shape=shape, rank=rank, warm_start=warm_start, seed=5)
               for _ in range(3)]
    for c in workers:
        c.set_workers(3)
    full = (1, *shape) if len(shape) == 2 else shape
    errors = [torch.zeros(full) for _ in workers]
    q = torch.randn(full[0], full[2], rank, generator=torch.Generator().manual_seed(5))
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        xs = [torch.randn(numel, generator=gen) for _ in workers]
        p_sum = sum(c.compress(x).view(torch.float32) for c, x in zip(workers, xs, strict=True))
        q_sum = sum(c.compress_round(1, p_sum).view(torch.float32) for c in workers)
        ys = [c.decompress(q_sum.view(torch.uint8)) for c in workers]
        ms = [x.view(full) + e for x, e in zip(xs, errors, strict=True)]
        if not warm_start and step:
            q = torch.randn(full[0], full[2], rank,
                            generator=torch.Generator().manual_seed(5 + step))
        expected, q = reference_step(ms, q)
        for c, y, m, e in zip(workers, ys, ms, errors, strict=True):
            torch.testing.assert_close(y.view(full), expected, rtol=1e-5, atol=1e-6)
            e.copy_(m - y.view(full) / 3)
            torch.testing.assert_close(c.error.view(full), e, rtol=1e-5, atol=1e-6)


def test_rank_one_matrix_is_recovered_and_error_is_zero():
    u, v = torch.arange(1.0, 5.0), torch.tensor([1.0, -2.0, 0.5])
    x = torch.outer(u, v).reshape(-1)
    c = PowerSGD(12, shape=(4, 3), rank=1)
    y = c.decompress(c.compress_round(1, c.compress(x)))
    torch.testing.assert_close(y, x)
    assert c.error.abs().max() < 1e-5


def test_state_round_trip_continues_identically():
    params = validate_compression_params({"compressor": "powersgd", "rank": 2, "ef": "vanilla",
                                          "shape": [10, 8]})
    a, b = build(params, 80), build(params, 80)
    for step in range(5):
        x = torch.randn(80, generator=torch.Generator().manual_seed(step))
        if step == 2:
            wire = msgpack.unpackb(msgpack.packb(state_to_wire(a.state_dict())))
            b.load_state_dict(state_from_wire(wire))
        pa = a.compress(x)
        ya = a.decompress(a.compress_round(1, pa))
        if step >= 2:
            pb = b.compress(x)
            assert torch.equal(pa, pb)
            assert torch.equal(ya, b.decompress(b.compress_round(1, pb)))
    with pytest.raises(ValueError, match="draws"):
        b.load_state_dict(dict(b.state_dict(), draws=-1))


def test_wrong_round_sizes_are_refused():
    c = PowerSGD(80, shape=(10, 8), rank=2)
    c.compress(torch.randn(80))
    with pytest.raises(ValueError, match="round 0 holds 19 values, expected 20"):
        c.compress_round(1, torch.zeros(19))
    with pytest.raises(ValueError, match="whole number"):
        c.compress_round(1, b"\0" * 7)
    with pytest.raises(ValueError, match="round 1 holds"):
        c.decompress(torch.zeros(20))


@pytest.mark.parametrize("params, exc, words", [
    ({"compressor": "powersgd"}, ValueError, ["'rank'", "required"]),
    ({"compressor": "powersgd", "rank": 0}, ValueError, ["rank", "0"]),
    ({"compressor": "powersgd", "rank": 1.5}, TypeError, ["rank", "1.5"]),
    ({"compressor": "topk", "k": 2, "rank": 2}, ValueError, ["rank", "powersgd", "topk"]),
    ({"compressor": "powersgd", "rank": 1, "momentum": "nesterov"}, ValueError,
     ["momentum", "powersgd", "optimizer"]),
    ({"compressor": "powersgd", "rank": 1, "orthogonalization_epsilon": -1e-8}, ValueError,
     ["orthogonalization_epsilon", "finite number >= 0"]),
    ({"compressor": "powersgd", "rank": 1, "min_compression_rate": float("inf")}, ValueError,
     ["min_compression_rate", "inf"]),
    ({"compressor": "powersgd", "rank": 1, "warm_start": 1}, TypeError, ["warm_start", "bool"]),
    ({"compressor": "powersgd", "rank": 1, "shape": [3]}, ValueError, ["shape", "[3]"]),
    ({"compressor": "powersgd", "rank": 1, "batch_tensors_with_same_shape": 1}, TypeError,
     ["batch_tensors_with_same_shape", "bool"]),
])
def test_bad_params_name_the_key(params, exc, words):
    with pytest.raises(exc) as info:
        validate_compression_params(params)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_planning_sends_whole_matrices_and_keeps_vectors_raw():
    params = validate_compression_params({"compressor": "powersgd", "rank": 2,
                                          "min_compress_bytes": 0, "warmup_steps": 3})
    parts, keys, small = plan_tensor("w", 512 * 300, params, torch.float16, 4096, (512, 300))
    # after warmup the whole matrix, compressed; during warmup raw partitions of 4096 bytes
    assert (parts[0].offset, parts[0].length, parts[0].only) == (0, 512 * 300, "compressed")
    assert (keys[0].field, keys[0].numel, keys[0].dtype) == \
        ("compressed_key", 512 * 300, torch.float32)
    assert keys[0].params["shape"] == [512, 300] and keys[0].wire_bytes == 4 * 812 * 2
    warm = parts[1:]
    assert all(p.only == "warmup" for p in warm) and len(warm) == 512 * 300 * 4 // 4096
    assert [(p.offset, p.length) for p in warm] == \
        [(i * 1024, 1024) for i in range(len(warm))]
    assert all((k.field, k.dtype, k.wire_bytes, k.warmup_only) ==
               ("raw_key", torch.float16, 2048, True) for k in keys[1:])
    assert not parts[0].travels(warm=True) and parts[0].travels(warm=False)
    assert warm[0].travels(warm=True) and not warm[0].travels(warm=False)
    conv = plan_tensor("c", 16 * 3 * 5 * 5, params, torch.float16, 1 << 20, (16, 3, 5, 5))
    assert conv[1][0].params["shape"] == [16, 75]
    assert not should_compress(10, 2, 2, 2.0)
    for shape in [(300,), (10, 2)]:  # a vector; a matrix PowerSGD would not shrink
        _, keys, _ = plan_tensor("b", int(np.prod(shape)), params, torch.float16, 1 << 20,
                                 shape)
        assert [(k.field, k.params, k.dtype) for k in keys] == [
            ("raw_key", None, torch.float16)]


def test_same_shape_matrices_share_one_batched_key_in_backward_order():
    params = validate_compression_params({"compressor": "powersgd", "rank": 2,
                                          "min_compress_bytes": 0,
                                          "batch_tensors_with_same_shape": True})
    keys, parts = [], {}
    for name, shape in [("a", (24, 24)), ("b", (24,)), ("c", (24, 24)), ("d", (6, 24)),
                        ("e", (24, 24))]:
        tensor_parts, tensor_keys, _ = plan_tensor(name, int(np.prod(shape)), params,
                                                   torch.float32, 1 << 20, shape)
        parts[name] = tensor_parts[0]
        keys += tensor_keys
    plans, batches = plan_batches(keys)
    assert [(k.name, k.params and k.params["shape"]) for k in plans] == [
        ("b[0]", None), ("d[0]", [6, 24]), ("batched(e[0], c[0], a[0])", [3, 24, 24])]
    assert len(batches) == 1 and batches[0].members == 3 and batches[0].numel == 3 * 576
    assert [parts[n].bucket_offset for n in "eca"] == [0, 576, 1152]
    assert parts["d"].bucket is None


LARGE_MATRIX_JOB = """
import torch
import bps
from bps.compressors.powersgd import PowerSGD
from bps.compressors import validate_compression_params
bps.init()
engine = bps.core.runtime.get().engine
params = validate_compression_params({"compressor": "powersgd", "rank": 1, "ef": "vanilla",
                                      "seed": 5, "shape": [100, 100]})
engine.declare(0, 10000, torch.float32, params, name="matrix")  # 40 kB: over the key limit
x = torch.randn(10000, generator=torch.Generator().manual_seed(1))
got = engine.push_pull(0, x.clone(), 0, 0.1).result(60)
alone = PowerSGD(10000, shape=(100, 100), rank=1, ef=True, seed=5)
p = alone.compress(x.clone()).view(torch.float32)
want = alone.decompress(alone.compress_round(1, p).view(torch.float32))
print("SAME" if torch.equal(got, want) else "DIFFERENT")
bps.shutdown()
"""


def test_a_powersgd_matrix_larger_than_a_key_travels_as_its_rounds():
    # Only the rounds (100 and 100 floats) travel, so a 100 x 100 matrix declares and
    # trains although 40 kB is over the 32 kB a key may have with 64 kB messages.
    import os
    import subprocess
    import sys

    done = subprocess.run([*BPSLAUNCH, "local", "--workers", "1", "--servers", "1", "--",
                           sys.executable, "-c", LARGE_MATRIX_JOB], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "BPS_MAX_MESSAGE_BYTES": "65536",
                               "BPS_TIMEOUT": "30"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "SAME" in done.stdout, done.stdout[-3000:]


WARMUP_MATRIX_JOB = """
import torch
import bps
bps.init()
torch.manual_seed(0)
model = torch.nn.Linear(150, 150, bias=False)  # 45 kB in float16: over a 32 kB key
reference = torch.nn.Linear(150, 150, bias=False)
reference.load_state_dict(model.state_dict())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
trainer = bps.DistributedTrainer(model, optimizer, {
    "compressor": "powersgd", "rank": 1, "warmup_steps": 2, "min_compress_bytes": 0})
x = torch.randn(8, 150)
for step in range(3):
    trainer.zero_grad()
    model(x).pow(2).mean().backward()
    trainer.step()
    if step < 2:  # warm-up: the raw float16 aggregate of one worker is its gradient
        reference.zero_grad()
        reference(x).pow(2).mean().backward()
        reference.weight.grad = reference.weight.grad.half().float()
        reference_optimizer.step()
        print(f"WARM {step} {torch.equal(model.weight, reference.weight)}")
print(f"TRAINED {bool(torch.isfinite(model.weight).all())}")
trainer.close()
bps.shutdown()
"""


def test_a_matrix_larger_than_a_key_travels_raw_during_warmup_in_partitions():
    """PowerSGD's warm-up steps send a matrix raw: in partitions, as any raw tensor, not
    whole on one key that the servers would refuse."""
    import os
    import subprocess
    import sys

    done = subprocess.run([*BPSLAUNCH, "local", "--workers", "1", "--servers", "1", "--",
                           sys.executable, "-c", WARMUP_MATRIX_JOB], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "BPS_MAX_MESSAGE_BYTES": "65536",
                               "BYTEPS_PARTITION_BYTES": "16384", "BPS_TIMEOUT": "30"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "WARM 0 True" in out and "WARM 1 True" in out, out[-3000:]
    assert "TRAINED True" in out, out[-3000:]
