"""Intra-node reduce/broadcast over real gloo groups between real processes."""

from __future__ import annotations

import functools
import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from bps.launch.role import free_port
from bps.worker.intranode import IntraNodeError, LocalGroup


def _member(rank: int, size: int, port: int, dtypes: tuple[str, ...], out) -> None:
    """One rank: for each dtype in turn, a reduce, a broadcast and a broadcast of bytes."""
    torch.set_num_threads(1)
    group = LocalGroup.connect(rank, size, "127.0.0.1", port, timeout_s=30)
    reduce_ch, bcast_ch = group.channel("reduce"), group.channel("broadcast")
    rng = np.random.default_rng(rank)
    contribution = rng.standard_normal(1000).astype(np.float32)
    results = {}
    for dtype in dtypes:
        tensor = torch.from_numpy(contribution.copy()).to(getattr(torch, dtype))
        reduce_ch.reduce(tensor)
        reduced = tensor.float().numpy().copy()
        if rank == 0:
            tensor.fill_(7)
        bcast_ch.broadcast(tensor)
        text = bcast_ch.broadcast_bytes(b"hello from root" if rank == 0 else None)
        results[dtype] = (contribution, reduced, tensor.float().numpy().copy(), text)
    out.put((rank, results))


@functools.cache
def _run_group(size: int, dtypes: tuple[str, ...]) -> dict:
    """{dtype: {rank: (contribution, reduced, broadcast, bytes)}} of one group of ``size``
    processes (cached: the tests of one group's results share its processes)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, size, port, dtypes, out))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        results: dict = {dtype: {} for dtype in dtypes}
        for _ in range(size):
            rank, by_dtype = out.get(timeout=60)
            for dtype, values in by_dtype.items():
                results[dtype][rank] = values
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


TWO_RANKS = (2, ("float32", "float16", "bfloat16"))  # one group serves the tests of 2 ranks


@pytest.mark.parametrize("size,dtype", [(2, "float32"), (3, "float16")])
def test_reduce_then_broadcast_matches_numpy(size, dtype):
    results = _run_group(*TWO_RANKS)[dtype] if size == 2 else _run_group(size, (dtype,))[dtype]
    np_dtype = np.float16 if dtype == "float16" else np.float32
    expected = sum(results[r][0].astype(np_dtype) for r in range(size))
    tol = 1e-2 if dtype == "float16" else 1e-6
    np.testing.assert_allclose(results[0][1], expected.astype(np.float32), rtol=tol, atol=tol)
    for r in range(size):
        np.testing.assert_array_equal(results[r][2], np.full(1000, 7, np.float32))
        assert results[r][3] == b"hello from root"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_two_rank_half_reduce_rounds_the_sum_once(dtype):
    # one addition: gloo adds in float32 and rounds to the dtype once, as torch does
    results = _run_group(*TWO_RANKS)[dtype]
    halves = [torch.from_numpy(results[r][0]).to(getattr(torch, dtype)) for r in range(2)]
    expected = (halves[0] + halves[1]).float().numpy()
    np.testing.assert_array_equal(results[0][1], expected)


def _lonely(port, out):
    try:
        LocalGroup.connect(0, 2, "127.0.0.1", port, timeout_s=2).channel("r").reduce(torch.ones(4))
    except IntraNodeError as exc:
        out.put(str(exc))


def test_missing_peer_times_out_with_clear_error():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_lonely, args=(free_port(), out))
    start = time.monotonic()
    proc.start()
    try:
        message = out.get(timeout=60)
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
    assert "local rank 0 of 2" in message
    assert time.monotonic() - start < 45


PAIRS = 6
ENDS_WITH_CHANNELS = """
import sys, torch
from bps.worker.intranode import IntraNodeError, LocalGroup
rank, port = int(sys.argv[1]), int(sys.argv[2])
group = LocalGroup.connect(rank, 2, "127.0.0.1", port, timeout_s=30)
channels = [group.channel(name) for name in ("setup", "reduce", "broadcast", "flags")]
tensor = torch.ones(1000)
for _ in range(3):
    channels[1].reduce(tensor)
    channels[2].broadcast(tensor)
channels[0].barrier()
group.close()  # what bps.shutdown() does; a trainer would still hold its channels
try:
    channels[1].reduce(tensor)
except IntraNodeError as exc:
    print(exc, flush=True)
"""


# tests/launch/test_cli.py's test_a_failing_local_rank_leaves_no_stray_abort covers the
# exit of a node's processes with their groups in make test
@pytest.mark.slow
def test_channels_still_referenced_at_exit_end_cleanly():
    # Left to the end of the interpreter, gloo's teardown aborted a third to a half of
    # such pairs of processes (exit code 134, "terminate called without an active
    # exception"); LocalGroup.close() destroys the groups first. Without it, all 6
    # pairs came through in 1 run of 10.
    import subprocess
    import sys

    for _ in range(PAIRS):
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-c", ENDS_WITH_CHANNELS, str(rank),
                                   str(port)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for rank in range(2)]
        try:
            outputs = [proc.communicate(timeout=60)[0] for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        for proc, output in zip(procs, outputs, strict=True):
            assert proc.returncode == 0, output
            assert "intra-node channel 'reduce' is closed" in output, output
