"""The membership generation a push carries is the one its step began with, through
real processes (``bpslaunch local --min-workers 2 --max-restarts 1``, three worker
nodes on the bare engine, one server). Each node pushes its two keys one at a time, so
the skip of the first key, naming a new generation, is back before the second key of
the same step is pushed. Node 2 kills itself at the start of step 1: both keys of
step 1 are skipped on the survivors. It starts again and joins; in step 2 (the one its
join drops) the second key must still carry the survivors' generation, or the server
would wait for the joiner's push of a step the joiner never pushes. Steps 0, 3 and 4
are the sums of all three nodes."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from tests.harness.trainer_job import launch

KEYS, STEPS, NUMEL = (0, 1), 5, 4
VICTIM, KILLED_AT, JOINED_AT = 2, 1, 2


def values(node: int, key: int, step: int) -> np.ndarray:
    """What ``node`` pushes: small integers, so every sum is exact in any order."""
    return np.arange(NUMEL, dtype=np.float32) + 100 * node + 10 * key + step


def outcome(result) -> list:
    """A push's answer as JSON: the sum, or ["skip", reason, generation, members]."""
    if hasattr(result, "reason"):
        return ["skip", result.reason, result.generation, list(result.members)]
    return result.numpy().tolist()


def node_main(cfg: dict) -> int:
    import torch

    from bps.common.env import ClusterEnv
    from bps.worker.engine import WorkerEngine

    out = Path(cfg["out"])
    engine = WorkerEngine.connect(ClusterEnv.from_environ())
    node, start, answers, joining = engine.node_id, 0, {}, engine.joining
    if joining:
        generation, _, source = engine.join()
        (out / "joined").write_text("")
    for key in KEYS:
        engine.declare(key, NUMEL, torch.float32, None, name=f"k{key}", server=0)
    if joining:
        start = int(engine.fetch_state(generation, source)[1].decode())
    for step in range(start, STEPS):
        if (node, step) == (VICTIM, KILLED_AT) and not (out / "killed").exists():
            (out / "killed").write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        if step == JOINED_AT and node != VICTIM:  # the joiner is a member by now
            deadline = time.monotonic() + 90
            while not (out / "joined").exists():
                assert time.monotonic() < deadline, "the restarted node never joined"
                time.sleep(0.01)
        for key in KEYS:  # one at a time
            pushed = torch.from_numpy(values(node, key, step))
            answers[f"{step}/{key}"] = outcome(
                engine.push_pull(key, pushed, step, 0.1).result(timeout=60))
        if step == JOINED_AT and node == 0:
            engine.publish_state(engine.generation, str(step + 1).encode())
    (out / f"answers{node}.json").write_text(json.dumps(answers))
    engine.close()
    return 0


def test_a_step_s_later_keys_carry_the_generation_it_began_with(tmp_path: Path) -> None:
    result = launch({}, tmp_path, workers=3, servers=1, timeout=180, module=__name__,
                    options=("--min-workers", "2", "--max-restarts", "1"))
    assert result.returncode == 0, result.stdout[-6000:]
    answers = [json.loads((tmp_path / f"answers{n}.json").read_text()) for n in range(3)]
    total = {f"{s}/{k}": sum(values(n, k, s) for n in range(3)).tolist()
             for s in range(STEPS) for k in KEYS}
    survivors = {**{f"{s}/{k}": total[f"{s}/{k}"] for s in (0, 3, 4) for k in KEYS},
                 **{f"1/{k}": ["skip", "membership", 1, [0, 1]] for k in KEYS},
                 **{f"2/{k}": ["skip", "membership", 2, [0, 1, 2]] for k in KEYS}}
    assert answers[0] == answers[1] == survivors
    assert answers[VICTIM] == {f"{s}/{k}": total[f"{s}/{k}"] for s in (3, 4) for k in KEYS}


if __name__ == "__main__":
    from bps.server.role import end_process

    end_process(node_main(json.loads(sys.argv[1])))
