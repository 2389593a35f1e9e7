"""bps.common.shm: the node agent's segments are unlinked once mapped, stale ones of
processes that are gone are removed, and too little room is an error that says how much."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from bps.common import shm


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_segment_is_shared_with_the_mapping_side_and_then_unlinked(tmp_path):
    mapped = []

    def reserve(path: str, size: int) -> None:  # the agent's side
        assert os.path.exists(path) and os.path.getsize(path) == size
        mapped.append(shm.map_segment(path, size))

    arena = shm.Arena("job:7", reserve, folder=str(tmp_path))
    first = arena.alloc(10)
    second = arena.alloc(3 * 4)
    assert first == (0, 0) and second == (0, shm.ALIGN)  # 64-byte aligned, no overlap
    assert len(mapped) == 1 and os.listdir(tmp_path) == []  # unlinked once mapped
    mine = arena.tensor(*second, 3, torch.float32)
    assert mine.tolist() == [0.0, 0.0, 0.0]
    mine.copy_(torch.tensor([1.5, -2.0, 3.25]))
    theirs = shm.tensor(mapped[0], second[1], 3, torch.float32)
    assert theirs.tolist() == [1.5, -2.0, 3.25]
    big = arena.alloc(shm.MIN_SEGMENT + 1)  # larger than what is left: a new segment
    assert big == (1, 0) and len(mapped) == 2 and len(mapped[1]) > shm.MIN_SEGMENT
    assert os.listdir(tmp_path) == []


def test_stale_segments_of_gone_processes_are_removed(tmp_path):
    stale = tmp_path / f"bps-job1-{dead_pid()}-0"
    live = tmp_path / f"bps-job1-{os.getpid()}-3"
    other = tmp_path / "bps-notours"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    assert shm.remove_stale(str(tmp_path)) == [str(stale)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


def test_too_little_room_says_how_much_is_needed(tmp_path):
    stat = os.statvfs(tmp_path)
    free = stat.f_bavail * stat.f_frsize
    with pytest.raises(shm.ShmError) as caught:
        shm.check_room(free + (1 << 40), str(tmp_path))
    message = str(caught.value)
    assert f"{(free + (1 << 40)) / (1 << 20):.1f} MiB" in message, message
    assert str(tmp_path) in message and "--shm-size" in message, message
    shm.check_room(1, str(tmp_path))  # room enough: no error


def test_the_module_examples_run():
    import doctest

    assert doctest.testmod(shm).failed == 0
