"""The worker program the parameter-server tests run under ``bpslaunch local``.

Not a test module itself (pytest collects nothing here); the tests import its data
generator, key tables and reference checks. Run as (``JOB`` is this file's path)::

    bpslaunch local --workers 3 --servers 2 -- python tests/harness/ps_job.py --out DIR --case raw

Each worker node declares the case's keys, pushes ``STEPS`` steps of deterministic data
and saves what it pulled (plus its placement and the answers to probe messages) to
``DIR/node{id}.pt``. Node 0 also sends malformed messages to every server while the
others train, and PULLs a finished step twice to check the bytes are the same.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading

import msgpack
import numpy as np
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


def compressed_keys() -> list[tuple[int, int, str, dict | None]]:
    """Two keys per described compressor, with and without error feedback (validated
    params)."""
    from bps.compressors import description, registered_names, validate_compression_params

    cases = []  # each compressor's first example bare, its last with error feedback
    for name in registered_names():
        told = description(name)
        if not told.payloads_sum:
            cases += [{"compressor": name, **told.examples[0]},
                      {"compressor": name, **told.examples[-1], "ef": "vanilla"}]
    keys = []
    for index, case in enumerate(cases):
        params = validate_compression_params(case)
        keys.append((200 + index, 3000 + 17 * index, "float32", params))
    return keys


KEY_TABLES = {"raw": raw_keys, "compressed": compressed_keys}


def member_socket(engine, address: str, suffix: bytes | None) -> zmq.Socket:
    """A DEALER to ``address`` holding the cluster key; with ``suffix``, its routing id
    carries ``engine``'s token, so the server takes it as that worker's connection."""
    from bps.common.auth import connect_as_client

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    if suffix is not None:  # unique: a ROUTER ignores a second peer with a routing id in use
        sock.setsockopt(zmq.ROUTING_ID, engine.token + suffix + os.urandom(4))
    connect_as_client(sock, engine.key)
    sock.connect(address)
    return sock


def probe_server(engine, address: str, known_key: int, node: int) -> dict[str, str]:
    """Send malformed messages to one server; returns name -> error text of the reply."""
    from bps.common.protocol import PROTOCOL_VERSION, Op, decode, encode

    sock = member_socket(engine, address, b"probe")
    stranger = member_socket(engine, address, None)  # holds the key, is no worker
    push = {"rid": 1, "key": known_key, "step": 0, "node": node, "dtype": "float32",
            "numel": 16384, "nbytes": 8, "lr": 0.1}
    full = encode(Op.PUSH, **{**push, "nbytes": 65536})  # the raw size of known_key
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
        "huge_register": [encode(Op.REGISTER, rid=1, key=424243, numel=2**28, dtype="float32",
                                 name="huge", params={"compressor": "onebit", "ef": "vanilla"},
                                 node=0)],
        "as_other_node": [encode(Op.PUSH, **{**push, "node": 1, "nbytes": 65536}),
                          b"\0" * 65536],
        # a payload in several frames that do not match its header (docs/runtime.md)
        "frames_missing": [full, *[b"\0" * 16384] * 3],
        "frames_extra": [full, *[b"\0" * 16384] * 5],
        "frames_uneven": [full, *(b"\0" * n for n in (16384, 8192, 16384, 24576))],
        "frames_short_last": [full, *[b"\0" * 16384] * 3, b"\0" * 8192],
        "frames_tiny": [full, *[b"\0" * 1024] * 64],
        "frames_oversize": [encode(Op.PUSH, **{**push, "nbytes": 2**33}), *[b"\0" * 4096] * 2],
        "frames_on_pull": [encode(Op.PULL, rid=1, key=known_key, step=0), b"\0" * 4096],
    }

    def ask(to, frames: list[bytes]) -> str:
        """One request's reply as ``OP: msg`` (``<no reply>`` within 10 s)."""
        to.send_multipart(frames)
        if not to.poll(10_000):
            return "<no reply>"
        header = decode(to.recv_multipart()[0])
        return f"{header['op'].name}: {header.get('msg', '')}"

    replies = {name: ask(sock, frames) for name, frames in probes.items()}
    # a connection that holds the key but belongs to no worker is refused every request
    for name, frames in {"stranger_push": probes["wrong_raw_size"][:1] + [b"\0" * 65536],
                         "stranger_pull": [encode(Op.PULL, rid=1, key=known_key, step=0)],
                         "stranger_get_state": [encode(Op.GET_STATE, rid=1, key=known_key)],
                         "stranger_register": probes["bad_dtype_register"]}.items():
        replies[name] = ask(stranger, frames)
    sock.close()
    stranger.close()
    return replies


ORDER_KEY = 10**6 + 1  # order_probe's keys: this one raw, the next one topk (lossless)
ORDER_NUMEL = 64


def order_values(node: int) -> torch.Tensor:
    """What order_probe pushes as ``node``: 1, 1e8, -1e8, 1, ... so that the float32 sum
    in node order ((1 + 1e8) - 1e8 = 0: 1 is under half an ulp of 1e8) differs from the
    sum in the order the probe sends them, last node first ((-1e8 + 1e8) + 1 = 1)."""
    return torch.full((ORDER_NUMEL,), [1.0, 1e8, -1e8][node % 3])


def order_probe(engine, address: str, workers: int) -> dict:
    """Every node pushes one step of two fresh keys from its own connection, highest node
    first (each waits for its ACK, then a barrier lets the next go, so the server receives
    them in that order); returns what came back to this node.

    ``raw``: the raw key's aggregate. For the topk key node 1's first push is garbage:
    ``refused`` (node 1) holds the replies to it (ACK, as it waits for node 0, then ERROR
    once it is decoded); ``topk`` is the aggregate after node 1 pushed again."""
    from bps.common.protocol import Op, decode, encode
    from bps.compressors import build, validate_compression_params

    node = engine.node_id
    sock = member_socket(engine, address, b"order")
    rid = iter(range(100, 10**6))

    def receive(until: set) -> list[tuple[dict, list]]:
        replies = []
        while not replies or replies[-1][0]["op"].name not in until:
            if not sock.poll(10_000):
                raise RuntimeError(f"order_probe: no reply from {address} after {replies}")
            header, *payload = sock.recv_multipart()
            replies.append((decode(header), payload))
        return replies

    def push(key: int, body: bytes, until: set) -> list[tuple[dict, list]]:
        sock.send_multipart([encode(Op.PUSH, rid=next(rid), key=key, step=0, node=node,
                                    dtype="float32", numel=ORDER_NUMEL, nbytes=len(body),
                                    lr=0.1), body])
        return receive(until)

    def turns(order: list[int], action) -> None:
        """``action()`` on node ``order[0]``, then a barrier, then the next node..."""
        for turn in order:
            if turn == node:
                action()
            engine.barrier()

    params = validate_compression_params({"compressor": "topk", "k": ORDER_NUMEL})
    topk = build(params, ORDER_NUMEL, torch.float32, role="worker")
    for key, key_params in ((ORDER_KEY, None), (ORDER_KEY + 1, params)):
        sock.send(encode(Op.REGISTER, rid=next(rid), key=key, numel=ORDER_NUMEL,
                         dtype="float32", name=f"order{key}", params=key_params, node=node))
        receive({"OK"})
    engine.barrier()
    mine = order_values(node).numpy().tobytes()
    turns(list(reversed(range(workers))), lambda: push(ORDER_KEY, mine, {"ACK"}))
    result: dict = {"raw": torch.frombuffer(bytearray(receive({"DATA"})[-1][1][0]),
                                            dtype=torch.float32)}
    encoded = topk.compress(order_values(node)).numpy().tobytes()
    refused: list = []
    turns([1], lambda: refused.extend(push(ORDER_KEY + 1, os.urandom(7), {"ACK"})))
    turns([n for n in reversed(range(workers)) if n != 1],
          lambda: push(ORDER_KEY + 1, encoded, {"ACK"}))
    if node == 1:  # decoded once node 0 is in: refused after its ACK
        refused += receive({"ERROR"})
        replies = push(ORDER_KEY + 1, encoded, {"DATA"})
    else:
        replies = receive({"DATA"})
    if node == 1:  # only worker 0 restores the servers' state
        sock.send_multipart([encode(Op.SET_STATE, rid=next(rid), key=ORDER_KEY + 1, nbytes=1),
                             b"\0"])
        result["set_state"] = receive({"ERROR"})[-1][0]["msg"]
    garbage = refused[0][0]["rid"] if refused else None
    result["refused"] = [(h["op"].name, h.get("msg", "")) for h, _ in refused
                         if h["rid"] == garbage]
    result["topk"] = topk.decompress(torch.frombuffer(bytearray(replies[-1][1][0]),
                                                      dtype=torch.uint8))
    engine.barrier()
    sock.close()
    return result


def garbage_push(engine, address: str, key: int, numel: int) -> str:
    """PUSH 7 random bytes as a compressed payload; returns the reply's text."""
    from bps.common.protocol import Op, decode, encode

    sock = member_socket(engine, address, b"garbage")
    sock.send_multipart([encode(Op.PUSH, rid=9, key=key, step=0, node=0, dtype="float32",
                                numel=numel, nbytes=7, lr=0.1), os.urandom(7)])
    reply = decode(sock.recv_multipart()[0]) if sock.poll(10_000) else {"msg": "<no reply>"}
    sock.close()
    return reply["msg"]


def pull_bytes(engine, address: str, key: int, step: int) -> bytes:
    """A raw PULL of a finished step, from a fresh connection of this worker."""
    from bps.common.protocol import Op, check_payload, decode, encode

    sock = member_socket(engine, address, b"pull")
    sock.send(encode(Op.PULL, rid=5, key=key, step=step))
    if not sock.poll(10_000):
        raise RuntimeError(f"no reply to PULL of key {key}")
    header, *payload = sock.recv_multipart()
    sock.close()
    header = decode(header)
    assert header["op"].name == "DATA", header
    check_payload("DATA", header["nbytes"], [len(frame) for frame in payload])
    return b"".join(payload)  # one frame, or several (BPS_FRAME_BYTES)


def fuzz_frames(rng: random.Random, keys: list[int]) -> list[bytes]:
    """One fuzzed message: garbage, a real op with random or hostile field values, wrong
    frame counts, huge declared sizes, far-future steps, REGISTERs of huge keys."""
    from bps.common.protocol import FIELDS, PROTOCOL_VERSION, Op

    def value() -> object:
        return rng.choice([0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, float("nan"),
                           "", "x" * rng.randrange(300), b"\0" * rng.randrange(64), None,
                           True, [], {}, {"compressor": "onebit", "ef": "vanilla"},
                           rng.choice(keys), rng.randrange(-5, 50), "float32", 10**9])
    kind = rng.randrange(8)
    if kind == 0:
        return [os.urandom(rng.randrange(0, 128))]
    if kind == 1:
        return [os.urandom(rng.randrange(1, 64)) for _ in range(rng.randrange(2, 5))]
    op = rng.choice(list(Op))
    header = {"v": PROTOCOL_VERSION if rng.random() < 0.9 else rng.randrange(5), "op": int(op)}
    for name in FIELDS[op]:
        if rng.random() < 0.9:
            header[name] = value()
    if kind in (2, 3) and op in FIELDS:  # a plausible request with one field off
        header.update(rid=rng.randrange(10**6), key=rng.choice(keys), step=rng.randrange(-2, 10**6),
                      node=rng.randrange(-1, 3), dtype="float32", numel=rng.choice([16384, 2**28]),
                      nbytes=rng.choice([65536, 2**33, 0]), lr=0.1, name="f", params=None)
    try:
        frame = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        frame = os.urandom(16)
    payloads = [os.urandom(rng.choice([0, 1, 7, 65536]))] if rng.random() < 0.5 else []
    if kind == 3 and rng.random() < 0.5:  # a payload in frames that may not fit 'nbytes'
        size = rng.choice([1024, 4096, 16384])
        payloads = [os.urandom(size) for _ in range(rng.randrange(2, 6))]
        if rng.random() < 0.5:
            payloads[rng.randrange(len(payloads))] = os.urandom(rng.randrange(0, 2 * size))
    return [frame, *payloads]


def fuzz(engine, count: int, seed: int) -> dict:
    """``count`` fuzzed messages from a connection that holds the cluster key but belongs
    to no worker, spread over every server and the scheduler and never read (their replies
    pile up on the other side); plus floods of GET_STATE and PULL of real keys from this
    worker's own connection, also never read, and a frame over the size limit."""
    from bps.common.env import ClusterEnv
    from bps.common.protocol import Op, encode

    rng = random.Random(seed)
    env = ClusterEnv.from_environ()
    targets = [member_socket(engine, address, None) for address in engine.servers]
    targets.append(member_socket(engine, env.scheduler_address, None))
    keys = list(engine.placement.servers) + [987654321]
    sent = 0
    for i in range(count):
        sock = targets[i % len(targets)]
        try:
            sock.send_multipart(fuzz_frames(rng, keys), zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
    own = [member_socket(engine, address, b"flood") for address in engine.servers]
    for server, sock in enumerate(own):
        known = next(k for k in engine.placement.servers if engine.placement.servers[k] == server)
        for rid in range(1000):
            sock.send(encode(Op.GET_STATE, rid=rid, key=known), zmq.NOBLOCK)
            sock.send(encode(Op.PULL, rid=rid, key=known, step=0), zmq.NOBLOCK)
    oversized = b"\0" * (env.max_message_bytes + 1)
    for sock in targets[:-1]:
        sock.send_multipart([encode(Op.PULL, rid=1, key=keys[0], step=0), oversized])
    for sock in targets + own:
        sock.close(linger=60_000)  # returns once all of it went out
    return {"sent": sent}


def loop(kill_pid: int, kill_at: int) -> None:
    """Train one key until something fails; at step ``kill_at`` SIGKILL ``kill_pid``."""
    import signal

    from bps.common.env import ClusterEnv
    from bps.launch.supervisor import mark_joined
    from bps.worker.engine import WorkerEngine

    engine = WorkerEngine.connect(ClusterEnv.from_environ())
    mark_joined(engine.node_id)  # no bps.init() here; see bps.launch.supervisor
    engine.declare(7, 1000, torch.float32, None, name="loop.weight")
    for step in range(10**6):
        if step == kill_at:
            print(f"node {engine.node_id}: killing pid {kill_pid or os.getpid()}", flush=True)
            os.kill(kill_pid or os.getpid(), signal.SIGKILL)
        engine.push_pull(7, torch.ones(1000), step, 0.1).result()


def bulk(steps: int, keys: int = 12, numel: int = 1_000_000) -> None:
    """Push and pull ``keys`` raw float32 keys of ``numel`` elements for ``steps`` steps
    (48 MB a step by default), each node's tensor all ``node + 1``: the sum is checked."""
    from bps.common.env import ClusterEnv
    from bps.launch.supervisor import mark_joined
    from bps.worker.engine import WorkerEngine

    engine = WorkerEngine.connect(ClusterEnv.from_environ())
    mark_joined(engine.node_id)  # no bps.init() here; see bps.launch.supervisor
    for key in range(keys):
        engine.declare(key, numel, torch.float32, None, name=f"bulk.{key}")
    tensor = torch.full((numel,), float(engine.node_id + 1))
    expected = engine.num_workers * (engine.num_workers + 1) / 2
    for step in range(steps):
        futures = [engine.push_pull(key, tensor, step, 0.1) for key in range(keys)]
        for key, future in enumerate(futures):
            total = future.result()
            assert bool((total == expected).all()), f"key {key} step {step}: wrong sum"
    engine.barrier()
    engine.close()


def train(fail_node: int, how: str, at: int) -> None:
    """A small DistributedTrainer job (bps.init) that runs until something fails; worker
    ``fail_node`` ends at step ``at`` as ``how`` says: ``raise`` (an exception), ``exit``
    (sys.exit(3)), ``interrupt`` (SIGINT, as Ctrl-C), ``stop`` (SIGSTOP), ``hang`` (the
    main thread stops, the process lives on), ``finish`` (bps.shutdown() after fewer
    steps than the others), ``lr`` (its learning rate is twice the others' throughout)."""
    import signal
    import sys

    import bps

    bps.init()
    model = torch.nn.Linear(8, 1)
    lr = 0.2 if how == "lr" and bps.rank() == fail_node else 0.1
    trainer = bps.DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=lr))
    steps = at if how == "finish" and bps.rank() == fail_node else 10**6
    for step in range(steps):
        if step == 1:
            print(f"worker {bps.rank()}: training", flush=True)
        if bps.rank() == fail_node and step == at:
            print(f"worker {fail_node}: {how} at step {step}", flush=True)
            if how == "raise":
                raise RuntimeError(f"boom at step {step}")
            if how == "exit":
                sys.exit(3)
            if how in ("interrupt", "stop"):
                os.kill(os.getpid(), signal.SIGINT if how == "interrupt" else signal.SIGSTOP)
            if how == "hang":
                threading.Event().wait()
        trainer.zero_grad()
        model(torch.ones(4, 8)).sum().backward()
        trainer.step()
    trainer.close()
    bps.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", choices=sorted(KEY_TABLES) + ["loop", "train", "bulk"],
                        default="raw")
    parser.add_argument("--fail", nargs=3, metavar=("NODE", "HOW", "STEP"),
                        help="train: worker NODE ends at STEP as HOW says (see train())")
    parser.add_argument("--kill-pid", type=int, default=0,
                        help="loop: SIGKILL this pid (0: ourselves) once --kill-at is reached")
    parser.add_argument("--kill-at", type=int, default=-1, help="loop: step of the kill")
    parser.add_argument("--fuzz", type=int, default=0,
                        help="node 0: send this many fuzzed messages while the job runs")
    args = parser.parse_args()
    if args.case == "loop":
        loop(args.kill_pid, args.kill_at)
        return
    if args.case == "train":
        train(int(args.fail[0]), args.fail[1], int(args.fail[2]))
        return
    if args.case == "bulk":
        bulk(steps=4)
        return

    from bps.common.env import ClusterEnv
    from bps.common.protocol import RemoteError, torch_dtype
    from bps.launch.supervisor import mark_joined
    from bps.worker.engine import WorkerEngine

    env = ClusterEnv.from_environ()
    if env.local_rank != 0:
        return
    engine = WorkerEngine.connect(env)
    mark_joined(engine.node_id)  # no bps.init() here; see bps.launch.supervisor
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
                probes[server] = probe_server(engine, address, known, node)
        prober = threading.Thread(target=probe_all)
        prober.start()
    fuzzed: dict = {}
    fuzzer = None
    if node == 0 and args.fuzz:
        fuzzer = threading.Thread(target=lambda: fuzzed.update(fuzz(engine, args.fuzz, 7)))
        fuzzer.start()
    if args.case == "raw":
        order = order_probe(engine, engine.servers[0], env.num_workers)
    if node == 0 and args.case == "compressed":
        probes = {key: garbage_push(engine, engine.servers[engine.placement.servers[key]], key,
                                    numel)
                  for key, numel, *_ in keys}
    results, in_place, bad_out = {}, {}, ""
    if args.case == "compressed":
        key, numel, dtype, _ = keys[0]
        try:  # refused before anything is sent: the key stays free for step 0
            engine.push_pull(key, torch.zeros(numel, dtype=torch_dtype(dtype)), 0, 0.1,
                             out=torch.zeros(numel + 1, dtype=torch_dtype(dtype)))
        except ValueError as exc:
            bad_out = str(exc)
        try:  # keys[0] has no error feedback: its chain cannot divide its input
            engine.push_pull(key, torch.zeros(numel, dtype=torch_dtype(dtype)), 0, 0.1,
                             divisor=2.0)
        except ValueError as exc:
            bad_out += "\n" + str(exc)
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
    if fuzzer is not None:
        fuzzer.join()
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
            last[key] = (pull_bytes(engine, address, key, final),
                         pull_bytes(engine, address, key, final))
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
                "order": order, "fuzzed": fuzzed, "connections": engine._io.connections,
                "stripes": dict(engine._io.stripes.stripe)},
               os.path.join(args.out, f"node{node}.pt"))


if __name__ == "__main__":
    # exits without the interpreter's finalization, which costs 0.3-0.5 s of CPU
    # per process after torch (every test's cluster is on the same two cores)
    from bps.server.role import end_process

    main()
    end_process(0)


# the launcher of the interpreter running the tests, wherever its scripts were installed
BPSLAUNCH = [sys.executable, "-m", "bps.launch.cli"]
JOB = os.path.abspath(__file__)  # this program, as a worker runs it

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


def numpy_sum(pushes: list[torch.Tensor]) -> np.ndarray:
    """Reference: sum in float32 (float64 for float64 data), like docs/architecture.md's servers,
    one push after the other in node order."""
    acc = np.float64 if pushes[0].dtype == torch.float64 else np.float32
    total = pushes[0].to(torch.float64).numpy().astype(acc)
    for push in pushes[1:]:
        total = total + push.to(torch.float64).numpy().astype(acc)
    return total


def check_raw_aggregates(runs: list[dict]) -> None:
    """Every node of a ``--case raw`` job (``runs``: its ``node{id}.pt`` files) got the
    numpy sum of every key and step, bit-identical across nodes."""
    for key, numel, dtype_name, _ in raw_keys():
        dtype = getattr(torch, dtype_name)
        for step in range(STEPS):
            pushes = [tensor_for(node, key, step, numel, dtype) for node in range(len(runs))]
            expected = torch.from_numpy(numpy_sum(pushes)).to(dtype)
            for node, run in enumerate(runs):
                got = run["results"][(key, step)]
                assert got.dtype == dtype and got.shape == (numel,), (key, node)
                # summed in node order, whatever the arrival order: bit-exact
                assert torch.equal(got, expected), f"key {key} step {step} node {node}"
    # every node got bit-identical aggregates: one sum per step on the server
    for key, step in runs[0]["results"]:
        assert all(torch.equal(run["results"][(key, step)], runs[0]["results"][(key, step)])
                   for run in runs)
