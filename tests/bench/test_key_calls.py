"""bench/key_calls.py: each call of a onebit + EF key is timed, per size."""

from __future__ import annotations

import doctest
import importlib.util
import subprocess
import sys

from tests.harness import paths


def _module():
    spec = importlib.util.spec_from_file_location("key_calls", paths.BENCH / "key_calls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_size_gets_a_row_of_positive_times():
    done = subprocess.run([sys.executable, str(paths.BENCH / "key_calls.py"), "--numel", "64",
                           "1000", "--number", "20", "--repeat", "1"],
                          capture_output=True, text=True, timeout=120, cwd=paths.ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [int(row[0]) for row in rows] == [64, 1000], done.stdout
    assert all(float(cell) > 0 for row in rows for cell in row[1:]), done.stdout


def test_key_calls_doctest():
    result = doctest.testmod(_module())
    assert result.attempted > 0 and result.failed == 0
