"""bench/gil_profile.py's summary of a py-spy recording: which process is a worker, what
is left out, and the shares it reports."""

from __future__ import annotations

import importlib.util

from tests.harness import paths


def load_bench():
    spec = importlib.util.spec_from_file_location("gil_profile", paths.BENCH / "gil_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WORKER = 'process 10:"python -m bps.launch.cli";process 12:"python train.py"'
SERVER = 'process 10:"python -m bps.launch.cli";process 11:"python -m bps.launch.cli"'
RAW = "\n".join([
    f"{WORKER};thread (3): bps-codec_0;Thread.run (threading.py:982);"
    "CodecPool._compress (bps/worker/codec_pool.py:140);KeyStaging.encode "
    "(bps/worker/device_path.py:115) 30",
    f"{WORKER};thread (4): bps-codec_1;Thread.run (threading.py:982);"
    "CodecPool._compress (bps/worker/codec_pool.py:140) 10",
    f"{WORKER};thread (5): bps-engine-io;IOLoop._run (bps/worker/io_loop.py:303) 40",
    f"{WORKER};thread (12): MainThread;<module> (train.py:3);_find_and_load "
    "(<frozen importlib._bootstrap>:1176);<module> (torch/__init__.py:1) 500",
    f"{WORKER};thread (12): MainThread;<module> (train.py:9);hook (bps/trainer.py:80) 20",
    f"{SERVER};thread (7): bps-server-engine-0;Server._sum (server/server.py:9) 900",
    "a line that is not a stack",
])


def test_workers_only_imports_left_out_codec_threads_as_one():
    bench = load_bench()
    report = bench.summary(bench.parse(RAW))
    assert 'process 12:"python train.py": 100 GIL samples outside imports' in report
    assert "process 11" not in report  # a server: no codec or engine thread
    assert " 40.0%  bps-codec" in report and " 40.0%  bps-engine-io" in report
    assert " 20.0%  MainThread" in report
    # inclusive and innermost per thread; generic frames (Thread.run) are not listed
    assert "KeyStaging.encode (device_path.py)" in report
    assert "CodecPool._compress (codec_pool.py)" in report
    assert "Thread.run" not in report and "torch/__init__" not in report


def test_a_recording_without_workers_says_so():
    bench = load_bench()
    assert bench.summary(bench.parse(f"{SERVER};thread (7): x;f (a.py:1) 3")) == \
        "no bps worker process in the recording"
