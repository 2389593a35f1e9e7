"""The worker program the parameter-server tests run under ``bpslaunch local``.

Not a test module itself (pytest collects nothing here); the tests import its data
generator and key tables to compute references. Run as::

    bpslaunch local --workers 3 --servers 2 -- python tests/ps_job.py --out DIR --case raw

Each worker node declares the case's keys, pushes ``STEPS`` steps of deterministic data
and saves what it pulled (plus its placement and the answers to probe messages) to
``DIR/node{id}.pt``. Node 0 also sends malformed messages to every server while the
others train, and PULLs a finished step twice to check the bytes are the same.
"""

from __future__ import annotations

import argparse
import os
import threading

import msgpack
import torch
import zmq

STEPS = 3
MISMATCH_KEY = 10**6


def tensor_for(node: int, key: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The data node ``node`` pushes for ``key`` at ``step`` (already 'averaged')."""
    gen = torch.Generator().manual_seed(1_000_003 * key + 7919 * step + node)
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * (node + 1)).to(dtype)


def lr_for(step: int) -> float:
    return 0.1 / (step + 1)


def raw_keys() -> list[tuple[int, int, str, dict | None]]:
    """(key, numel, dtype, params): raw keys of several dtypes; 0..5 are one big tensor
    cut into partitions of BYTEPS_PARTITION_BYTES=65536 (worker/partition.py)."""
    keys = [(k, 16384 if k < 5 else 3000, "float32", None) for k in range(6)]
    keys += [(100, 5000, "float16", None), (101, 777, "bfloat16", None),
             (102, 4321, "float64", None), (103, 1, "float32", None)]
    return keys


def compressed_keys(seed: int = 12345) -> list[tuple[int, int, str, dict | None]]:
    """One key per compressor, with and without error feedback (validated params)."""
    from bps.config import validate_compression_params

    cases = [
        {"compressor": "onebit", "scaling": True},
        {"compressor": "onebit", "scaling": True, "ef": "vanilla"},
        {"compressor": "topk", "k": 0.05},
        {"compressor": "topk", "k": 50, "ef": "vanilla"},
        {"compressor": "randomk", "k": 0.05, "seed": seed},
        {"compressor": "randomk", "k": 40, "ef": "vanilla", "seed": seed},
        {"compressor": "dithering", "k": 4, "seed": seed},
        {"compressor": "dithering", "k": 3, "partition": "natural", "normalize": "l2",
         "ef": "vanilla", "seed": seed},
        {"compressor": "bytegrad"},
        {"compressor": "bytegrad", "chunk": 256, "ef": "vanilla"},
    ]
    keys = []
    for index, case in enumerate(cases):
        params = validate_compression_params(case)
        keys.append((200 + index, 3000 + 17 * index, "float32", params))
    return keys


KEY_TABLES = {"raw": raw_keys, "compressed": compressed_keys}


def probe_server(address: str, known_key: int, node: int) -> dict[str, str]:
    """Send malformed messages to one server; returns name -> error text of the reply."""
    from bps.protocol import PROTOCOL_VERSION, Op, decode, encode

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    push = {"rid": 1, "key": known_key, "step": 0, "node": node, "dtype": "float32",
            "numel": 16384, "nbytes": 8, "lr": 0.1}
    bad_version = msgpack.packb({"v": PROTOCOL_VERSION + 1, "op": int(Op.PULL), "rid": 1,
                                 "key": known_key, "step": 0})
    probes = {
        "random_bytes": [os.urandom(64)],
        "empty_header": [b""],
        "wrong_version": [bad_version],
        "unknown_op": [msgpack.packb({"v": PROTOCOL_VERSION, "op": 99, "rid": 1})],
        "missing_field": [encode(Op.PUSH, rid=1, key=known_key)],
        "wrong_type": [encode(Op.PULL, rid=1, key="x", step=0)],
        "unknown_key": [encode(Op.PULL, rid=1, key=987654321, step=0)],
        "wrong_size": [encode(Op.PUSH, **push), b"\0" * 12],
        "wrong_raw_size": [encode(Op.PUSH, **push), b"\0" * 8],
        "wrong_numel": [encode(Op.PUSH, **{**push, "numel": 5, "nbytes": 20}), b"\0" * 20],
        "wrong_dtype": [encode(Op.PUSH, **{**push, "dtype": "float64", "nbytes": 131072}),
                        b"\0" * 131072],
        "bad_node": [encode(Op.PUSH, **{**push, "node": 77, "nbytes": 65536}), b"\0" * 65536],
        "no_payload": [encode(Op.PUSH, **push)],
        "stale_step": [encode(Op.PUSH, **{**push, "step": -5, "nbytes": 65536}),
                       b"\0" * 65536],
        "bad_dtype_register": [encode(Op.REGISTER, rid=1, key=424242, numel=4, dtype="int8",
                                      name="junk", params=None, node=0)],
    }
    replies = {}
    for name, frames in probes.items():
        sock.send_multipart(frames)
        if not sock.poll(10_000):
            replies[name] = "<no reply>"
            continue
        header = decode(sock.recv_multipart()[0])
        replies[name] = f"{header['op'].name}: {header.get('msg', '')}"
    sock.close()
    return replies


ORDER_KEY = 10**6 + 1  # order_probe's keys: this one raw, the next one topk (lossless)
ORDER_NUMEL = 64


def order_values(node: int) -> torch.Tensor:
    """What order_probe pushes as ``node``: 1, 1e8, -1e8, 1, ... so that the float32 sum
    in node order ((1 + 1e8) - 1e8 = 0: 1 is under half an ulp of 1e8) differs from the
    sum in the order the probe sends them, last node first ((-1e8 + 1e8) + 1 = 1)."""
    return torch.full((ORDER_NUMEL,), [1.0, 1e8, -1e8][node % 3])


def order_probe(address: str, workers: int) -> dict:
    """Push one step of two fresh keys as every node, highest node first, through one
    socket (so the server receives them in that order); returns what came back.

    ``raw``: the raw key's aggregate. ``refused``: for the topk key, where node 1's
    first push is garbage: the replies to it (ACK, as it waits for node 0, then ERROR
    once it is decoded) and the aggregate after node 1 pushes again."""
    from bps.compressors import build
    from bps.config import validate_compression_params
    from bps.protocol import Op, decode, encode

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    rid = iter(range(100, 10**6))

    def request(frames: list, until: set) -> list[tuple[dict, list]]:
        sock.send_multipart(frames)
        replies = []
        while not replies or replies[-1][0]["op"].name not in until:
            if not sock.poll(10_000):
                raise RuntimeError(f"order_probe: no reply from {address} after {replies}")
            header, *payload = sock.recv_multipart()
            replies.append((decode(header), payload))
        return replies

    def push(key: int, node: int, body: bytes, until: set) -> list[tuple[dict, list]]:
        return request([encode(Op.PUSH, rid=next(rid), key=key, step=0, node=node,
                               dtype="float32", numel=ORDER_NUMEL, nbytes=len(body), lr=0.1),
                        body], until)

    params = validate_compression_params({"compressor": "topk", "k": ORDER_NUMEL})
    topk = build(params, ORDER_NUMEL, torch.float32, role="worker")
    for key, key_params in ((ORDER_KEY, None), (ORDER_KEY + 1, params)):
        request([encode(Op.REGISTER, rid=next(rid), key=key, numel=ORDER_NUMEL,
                        dtype="float32", name=f"order{key}", params=key_params, node=0)],
                {"OK"})
    result: dict = {}
    for node in reversed(range(workers)):
        body = order_values(node).numpy().tobytes()
        replies = push(ORDER_KEY, node, body, {"DATA"} if node == 0 else {"ACK"})
    result["raw"] = torch.frombuffer(bytearray(replies[-1][1][0]), dtype=torch.float32)
    encoded = {node: topk.compress(order_values(node)).numpy().tobytes()
               for node in range(workers)}
    refused = push(ORDER_KEY + 1, 1, os.urandom(7), {"ACK"})
    garbage = refused[-1][0]["rid"]
    for node in reversed(range(2, workers)):
        push(ORDER_KEY + 1, node, encoded[node], {"ACK"})
    refused += push(ORDER_KEY + 1, 0, encoded[0], {"ERROR"})
    replies = push(ORDER_KEY + 1, 1, encoded[1], {"DATA"})
    result["refused"] = [(h["op"].name, h.get("msg", "")) for h, _ in refused
                         if h["rid"] == garbage]
    result["topk"] = topk.decompress(torch.frombuffer(bytearray(replies[-1][1][0]),
                                                      dtype=torch.uint8))
    sock.close()
    return result


def garbage_push(address: str, key: int, numel: int) -> str:
    """PUSH 7 random bytes as a compressed payload; returns the reply's text."""
    from bps.protocol import Op, decode, encode

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart([encode(Op.PUSH, rid=9, key=key, step=0, node=0, dtype="float32",
                                numel=numel, nbytes=7, lr=0.1), os.urandom(7)])
    reply = decode(sock.recv_multipart()[0]) if sock.poll(10_000) else {"msg": "<no reply>"}
    sock.close()
    return reply["msg"]


def pull_bytes(address: str, key: int, step: int) -> bytes:
    """A raw PULL of a finished step, from a fresh connection."""
    from bps.protocol import Op, decode, encode

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(encode(Op.PULL, rid=5, key=key, step=step))
    if not sock.poll(10_000):
        raise RuntimeError(f"no reply to PULL of key {key}")
    header, *payload = sock.recv_multipart()
    sock.close()
    assert decode(header)["op"].name == "DATA", decode(header)
    return payload[0]


def loop(kill_pid: int, kill_at: int) -> None:
    """Train one key until something fails; at step ``kill_at`` SIGKILL ``kill_pid``."""
    import signal

    from bps.env import ClusterEnv
    from bps.worker.engine import WorkerEngine

    engine = WorkerEngine.connect(ClusterEnv.from_environ())
    engine.declare(7, 1000, torch.float32, None, name="loop.weight")
    for step in range(10**6):
        if step == kill_at:
            print(f"node {engine.node_id}: killing pid {kill_pid or os.getpid()}", flush=True)
            os.kill(kill_pid or os.getpid(), signal.SIGKILL)
        engine.push_pull(7, torch.ones(1000), step, 0.1).result()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", choices=sorted(KEY_TABLES) + ["loop"], default="raw")
    parser.add_argument("--kill-pid", type=int, default=0,
                        help="loop: SIGKILL this pid (0: ourselves) once --kill-at is reached")
    parser.add_argument("--kill-at", type=int, default=-1, help="loop: step of the kill")
    args = parser.parse_args()
    if args.case == "loop":
        loop(args.kill_pid, args.kill_at)
        return

    from bps.env import ClusterEnv
    from bps.protocol import RemoteError, torch_dtype
    from bps.worker.engine import WorkerEngine

    env = ClusterEnv.from_environ()
    if env.local_rank != 0:
        return
    engine = WorkerEngine.connect(env)
    node = engine.node_id
    keys = KEY_TABLES[args.case]()
    for key, numel, dtype, params in keys:
        engine.declare(key, numel, torch_dtype(dtype), params, name=f"t{key}")
    probes: dict = {}
    order: dict = {}
    prober = None
    if node == 0 and args.case == "raw":
        def probe_all() -> None:
            for server, address in enumerate(engine.servers):
                known = next(k for k, *_ in keys if engine.placement.servers[k] == server)
                probes[server] = probe_server(address, known, node)
        prober = threading.Thread(target=probe_all)
        prober.start()
        order = order_probe(engine.servers[0], env.num_workers)
    if node == 0 and args.case == "compressed":
        probes = {key: garbage_push(engine.servers[engine.placement.servers[key]], key, numel)
                  for key, numel, *_ in keys}
    results, in_place, bad_out = {}, {}, ""
    if args.case == "compressed":
        key, numel, dtype, _ = keys[0]
        try:  # refused before anything is sent: the key stays free for step 0
            engine.push_pull(key, torch.zeros(numel, dtype=torch_dtype(dtype)), 0, 0.1,
                             out=torch.zeros(numel + 1, dtype=torch_dtype(dtype)))
        except ValueError as exc:
            bad_out = str(exc)
    for step in range(STEPS):
        # compressed keys, odd steps: the aggregate is decoded into the pushed tensor
        decode_in_place = args.case == "compressed" and step % 2 == 1
        tensors = {key: tensor_for(node, key, step, numel, torch_dtype(dtype))
                   for key, numel, dtype, _ in keys}
        futures = {key: engine.push_pull(
            key, tensors[key], step, lr_for(step), priority=-index,
            out=tensors[key] if decode_in_place else None)
            for index, (key, *_) in enumerate(keys)}
        for key, fut in futures.items():
            result = fut.result()
            if decode_in_place:
                in_place[(key, step)] = result.data_ptr() == tensors[key].data_ptr()
            results[(key, step)] = result.clone()
    stats = engine.stats
    if prober is not None:
        prober.join()
    if args.case == "compressed":
        # a step that is then undone: state_dict, a garbage step, load_state_dict, the
        # real step STEPS must come out as if the garbage never happened
        state = engine.state_dict()
        garbage = [engine.push_pull(key, torch.randn(numel).to(torch_dtype(dtype)) * 100,
                                    STEPS, 1.0) for key, numel, dtype, _ in keys]
        for future in garbage:
            future.result()
        engine.load_state_dict(state)
        futures = {key: engine.push_pull(
            key, tensor_for(node, key, STEPS, numel, torch_dtype(dtype)), STEPS,
            lr_for(STEPS)) for key, numel, dtype, _ in keys}
        results.update({(key, STEPS): fut.result().clone() for key, fut in futures.items()})
    last = {}
    if node == 0:
        for key, *_ in keys:
            address = engine.servers[engine.placement.servers[key]]
            final = max(step for k, step in results if k == key)
            last[key] = (pull_bytes(address, key, final), pull_bytes(address, key, final))
    engine.barrier()
    mismatch = ""
    if node == 0:
        engine.declare(MISMATCH_KEY, 10, torch.float32, None, name="model.a")
    engine.barrier()
    if node == 1:
        try:
            engine.declare(MISMATCH_KEY, 11, torch.float32, None, name="model.b")
        except RemoteError as exc:
            mismatch = str(exc)
    engine.barrier()
    engine.close()
    torch.save({"results": results, "in_place": in_place, "bad_out": bad_out,
                "placement": dict(engine.placement.servers),
                "loads": list(engine.placement.loads), "probes": probes, "last": last,
                "mismatch": mismatch, "stats": stats.__dict__, "servers": engine.servers,
                "order": order},
               os.path.join(args.out, f"node{node}.pt"))


if __name__ == "__main__":
    main()


TEST_ENV = {"BPS_TIMEOUT": "20", "BPS_HEARTBEAT_INTERVAL": "0.2", "BPS_HEARTBEAT_TIMEOUT": "6",
            "BYTEPS_PARTITION_BYTES": "65536", "BPS_SERVER_THREADS": "2",
            "PYTHONUNBUFFERED": "1"}


def default_sigint() -> None:
    """Popen ``preexec_fn`` for launchers a test interrupts: a shell starts background jobs
    (``make test &``, nohup) with SIGINT ignored, and Python then keeps ignoring it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_command(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run a launcher (own process group), return (exit code, output); on timeout or any
    error, SIGTERM then SIGKILL the whole group so no process outlives the test."""
    import signal
    import subprocess

    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=15)
        raise AssertionError(f"{argv} did not finish within {timeout} s:\n{output}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
