"""bench/agent_stages.py end to end on a tiny model: the node agent's stages are timed
in its own process, and counted per step."""

from __future__ import annotations

import doctest
import importlib.util
import re
import subprocess
import sys

import pytest

from tests.harness import paths


@pytest.mark.parametrize("comm_dtype", ["fp16", pytest.param("bf16", marks=pytest.mark.slow)])
def test_each_stage_is_counted_per_agent_step(comm_dtype):
    # 3 x Linear(128, 128): three compressed weights, and the three biases in one bucket
    # of the wire's dtype, pushed and landed in one pass (_land_fused)
    done = subprocess.run([sys.executable, str(paths.BENCH / "agent_stages.py"), "--steps",
                           "6", "--", "--layers", "3", "--width", "128", "--warmup", "1",
                           "--comm-dtype", comm_dtype],
                          capture_output=True, text=True, timeout=240, cwd=paths.ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {m["call"]: (float(m["calls"]), float(m["us"]))
            for m in re.finditer(r"\(`(?P<call>[\w.]+)`\) \| (?P<calls>[\d.]+) \| "
                                 r"(?P<us>[\d.]+) \|", done.stdout)}
    per_step = {"_NodePipe.arrive": 3, "CodecPool._run_chain": 3, "CodecPool._decompress": 3,
                "OneBit.compress_with_error": 3, "OneBit.decompress": 3,
                "GradPipeline._land": 3, "_NodePipe.arrive_fused": 1,
                "GradPipeline._land_fused": 1}
    for call, calls in per_step.items():
        assert call in rows, done.stdout
        assert rows[call][0] == calls and rows[call][1] > 0, (call, rows[call])
    # a push holds its chain, which holds onebit's passes; a decode holds onebit's
    assert rows["_NodePipe.arrive"][1] > rows["CodecPool._run_chain"][1] \
        > rows["OneBit.compress_with_error"][1], rows
    assert rows["CodecPool._decompress"][1] > rows["OneBit.decompress"][1], rows
    assert "| host, node agent |" in done.stdout


def test_stage_table_doctest():
    spec = importlib.util.spec_from_file_location("agent_stages",
                                                  paths.BENCH / "agent_stages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
