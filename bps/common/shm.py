"""Shared-memory segments between a training process and its node agent.

A segment is a file in ``/dev/shm`` named after the job and the process that made it
(``bps-<job>-<pid>-<n>``). It lives there only until the agent has mapped it: then the
maker unlinks it and both processes keep their mappings, so nothing is left in
``/dev/shm`` after any exit, ``kill -9`` included (the pages go when the last mapping
does). A process killed in the short window before the unlink leaves its file behind;
:func:`remove_stale` deletes the files of processes that are gone at the next start.

Usage::

    from bps.common.shm import Arena

    arena = Arena("job-1234", reserve=lambda path, size: agent.map(path, size))
    seg, offset = arena.alloc(4096)             # 64-byte aligned, zeroed
    view = arena.tensor(seg, offset, 1024, torch.float32)

The mappings last as long as the process: tensors over them are handed out for the
whole job, and a mapping with exported buffers cannot be closed.

:func:`check_room` raises a :class:`ShmError` saying how much is needed before a
segment that would not fit in ``/dev/shm`` is made (a tmpfs too small for a container
is common: ``docker run --shm-size``); segments are reserved with ``posix_fallocate``,
so a full ``/dev/shm`` fails there, not with a SIGBUS at the first write.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Callable

import torch

SHM_DIR = "/dev/shm"
ALIGN = 64
MIN_SEGMENT = 8 << 20  # bytes a new segment holds at least
_NAME = re.compile(r"^bps-[A-Za-z0-9_.]+-(\d+)-\d+$")

__all__ = ["Arena", "ShmError", "check_room", "map_segment", "remove_stale", "segment_path"]


class ShmError(RuntimeError):
    """Shared memory for the node agent could not be set up; the message says why."""


def segment_path(job: str, pid: int, index: int, folder: str = SHM_DIR) -> str:
    """The file of segment ``index`` of process ``pid`` of ``job``.

        >>> segment_path("j7", 42, 0, "/dev/shm")
        '/dev/shm/bps-j7-42-0'
    """
    return os.path.join(folder, f"bps-{job}-{pid}-{index}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale(folder: str = SHM_DIR) -> list[str]:
    """Delete the segments whose making process is gone; returns their paths."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            path = os.path.join(folder, name)
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def check_room(size: int, folder: str = SHM_DIR) -> None:
    """Raise :class:`ShmError` where ``folder`` has less than ``size`` bytes free."""
    try:
        stat = os.statvfs(folder)
    except OSError as exc:
        raise ShmError(f"BPS_NODE_AGENT=1 needs shared memory in {folder}: {exc}") from None
    free = stat.f_bavail * stat.f_frsize
    if free < size:
        raise ShmError(
            f"BPS_NODE_AGENT=1 needs {_mib(size)} more shared memory in {folder}, which has "
            f"{_mib(free)} free of {_mib(stat.f_blocks * stat.f_frsize)}: enlarge it (docker: "
            f"--shm-size; a tmpfs: mount -o remount,size=...) or unset BPS_NODE_AGENT")


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def create_segment(path: str, size: int) -> mmap.mmap:
    """Make the file ``path`` of ``size`` bytes (reserved) and map it."""
    check_room(size, os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.unlink(path)
            raise ShmError(f"BPS_NODE_AGENT=1 could not reserve {_mib(size)} in "
                           f"{os.path.dirname(path)}: {exc}; enlarge it (docker: --shm-size) "
                           f"or unset BPS_NODE_AGENT") from None
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def map_segment(path: str, size: int) -> mmap.mmap:
    """Map the existing segment ``path`` (the agent's side)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def tensor(segment: mmap.mmap, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``numel`` x ``dtype`` over ``segment`` at byte ``offset``."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(segment, dtype=dtype, count=numel, offset=offset)


class Arena:
    """Bump allocation over segments made on demand; ``reserve(path, size)`` is called
    with each new segment before its file is unlinked (the other process maps it then)."""

    def __init__(self, job: str, reserve: Callable[[str, int], None],
                 folder: str = SHM_DIR) -> None:
        self.job = re.sub(r"[^A-Za-z0-9_.]", "_", job)
        self.folder = folder
        self._reserve = reserve
        self.segments: list[mmap.mmap] = []
        self._used = 0  # bytes allocated in the last segment

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """``(segment index, byte offset)`` of ``nbytes`` fresh zeroed bytes."""
        nbytes = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if not self.segments or self._used + nbytes > len(self.segments[-1]):
            self._grow(max(nbytes, MIN_SEGMENT))
        offset = self._used
        self._used += nbytes
        return len(self.segments) - 1, offset

    def _grow(self, size: int) -> None:
        path = segment_path(self.job, os.getpid(), len(self.segments), self.folder)
        segment = create_segment(path, size)
        try:
            self._reserve(path, size)
        except BaseException:
            segment.close()  # nothing was handed out over it
            raise
        finally:
            os.unlink(path)  # both sides hold a mapping now (or the agent never will)
        self.segments.append(segment)
        self._used = 0

    def tensor(self, index: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor over segment ``index`` at ``offset``."""
        return tensor(self.segments[index], offset, numel, dtype)
