"""Compressor throughput: bps's numba kernels vs plain torch vs memory copy.

    .venv/bin/python bench/compressors.py            # 16M float32 elements, ~2-4 minutes
    .venv/bin/python bench/compressors.py --only dithering --torch-runs 0   # one, no baseline

powersgd rows: one worker's step on a square matrix of about ``--numel`` elements (both
rounds as compress; P Q^T and the error as decompress) against the same step with the
ops of PyTorch's ``powerSGD_hook`` (its ``_orthogonalize``, ``bmm``, error feedback),
the two run by turns; "torch ms" gives the baseline's compress + decompress.

For each compressor: median time of compress and of decompress (into a preallocated
output, as the server and engine do) after warm-up; throughput = input bytes /
(compress + decompress); "x copy" = that throughput / np.copyto bandwidth of the same
array, the copy timed between the compressor's runs (its median is the row's "copy ms"),
so that both see the same moment of a host whose speed drifts; "x torch" = speed-up
over a plain-torch implementation of the same algorithm (written below; its RNG is
torch's, as xorshift128+ is sequential); ratio = input bytes / payload bytes. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from bps.compressors import build, description, registered_names

SHIFTS32 = 31 - torch.arange(32, dtype=torch.int64)


def median_time(fn, runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- plain-torch implementations of the same algorithms -----------------------------

class TorchOneBit:
    def compress(self, x):
        scale = (x.abs().sum(dtype=torch.float64) / x.numel()).float()
        bits = (x < 0).view(-1, 32).to(torch.int64)
        words = (bits << SHIFTS32).sum(1).to(torch.int32)
        return words, scale

    def decompress(self, payload, out):
        words, scale = payload
        bits = (words.to(torch.int64).view(-1, 1) >> SHIFTS32) & 1
        torch.where(bits.view(-1).bool(), -scale, scale, out=out)
        return out


class TorchTopK:
    def __init__(self, k):
        self.k = k

    def compress(self, x):
        indices = torch.topk(x.abs(), self.k, sorted=False).indices
        return indices.to(torch.int32), x[indices]

    def decompress(self, payload, out):
        indices, values = payload
        out.zero_()
        out[indices.long()] = values
        return out


class TorchRandomK:
    def __init__(self, k):
        self.k = k
        self.gen = torch.Generator().manual_seed(1)

    def compress(self, x):
        indices = torch.randint(0, x.numel(), (self.k,), generator=self.gen)
        return indices, x[indices]

    def decompress(self, payload, out):
        indices, values = payload
        out.zero_()
        out.index_put_((indices,), values)
        return out


class TorchByteGrad:
    """Min-max uint8 per chunk, vectorised (numel a multiple of the chunk)."""

    def __init__(self, chunk):
        self.chunk = chunk

    def compress(self, x):
        rows = x.view(-1, self.chunk)
        lo, hi = rows.amin(1, keepdim=True), rows.amax(1, keepdim=True)
        w = (hi - lo) / 256
        q = ((rows - lo) / w).floor().clamp_(max=255).nan_to_num_(0).to(torch.uint8)
        return q, lo, w

    def decompress(self, payload, out):
        q, lo, w = payload
        torch.add(lo, (q.float() + 0.5) * w, out=out.view(q.shape))
        return out


class OneWorkerPowerSGD:
    """bps's powersgd as one worker runs it, the servers' sums being its own rounds:
    compress = round 0 and round 1, decompress = P Q^T and the error."""

    def __init__(self, shape, rank):
        from bps.compressors.powersgd import PowerSGD

        self.codec = PowerSGD(shape[0] * shape[1], shape=shape, rank=rank, ef=True)

    def compress(self, x):
        return self.codec.compress_round(1, self.codec.compress(x))

    def decompress(self, payload, out):
        return self.codec.decompress(payload, out)


class TorchPowerSGD:
    """The same step with the ops of PyTorch's powerSGD_hook (its _orthogonalize, bmm,
    error feedback), one worker, allreduce left out."""

    def __init__(self, shape, rank):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        self.orth = powerSGD_hook._orthogonalize
        n, m = shape
        self.error = torch.zeros(n * m)
        self.q = torch.randn(1, m, rank)
        self.p = torch.empty(1, n, rank)
        self.shape = (1, n, m)

    def compress(self, x):
        x = x + self.error
        self.m = x.view(self.shape)
        self.orth(self.q)
        torch.bmm(self.m, self.q, out=self.p)
        self.orth(self.p)
        torch.bmm(self.m.transpose(1, 2), self.p, out=self.q)
        return self.q

    def decompress(self, payload, out):
        torch.bmm(self.p, payload.transpose(1, 2), out=out.view(self.shape))
        self.error = self.m.view(-1) - out
        return out


def bit_len(values):
    """bit length of positive int64 values (exact below 2**52)."""
    return torch.floor(torch.log2(values.double())).long() + 1


def delta_codes(values):
    """Elias-delta (code, length) per value: the code has lb - 1 leading zeros."""
    b = bit_len(values)
    lb = bit_len(b)
    return (b << (b - 1)) | (values - (1 << (b - 1))), 2 * lb - 1 + b - 1


def windows(bits, width):
    """window[p] = the next `width` bits from p, MSB first (zero padded)."""
    padded = torch.cat([bits.long(), torch.zeros(width, dtype=torch.int64)])
    total = torch.zeros(bits.numel() + 1, dtype=torch.int64)
    for j in range(width):
        total += padded[j : j + bits.numel() + 1] << (width - 1 - j)
    return total


class TorchDithering:
    """Linear dithering, max norm; Elias-delta coded with vectorised torch ops."""

    def __init__(self, levels):
        self.s = levels
        self.gen = torch.Generator().manual_seed(1)

    def compress(self, x):
        scale = x.abs().max().double()
        u = (x.abs().double() / scale * self.s).float()
        low = u.floor()
        q = (low + (torch.rand(x.numel(), generator=self.gen) < (u - low))).long()
        index = q.nonzero().squeeze(1)
        gaps = torch.diff(index, prepend=torch.tensor([-1]))
        gap_code, gap_len = delta_codes(gaps)
        q_code, q_len = delta_codes(q[index])
        codes = torch.stack([gap_code, (x[index] < 0).long(), q_code], 1).view(-1)
        lengths = torch.stack([gap_len, torch.ones_like(gap_len), q_len], 1).view(-1)
        starts = torch.cumsum(lengths, 0) - lengths
        nbits = int(lengths.sum())
        field = torch.repeat_interleave(torch.arange(codes.numel()), lengths)
        offset = torch.arange(nbits) - starts[field]
        bits = ((codes[field] >> (lengths[field] - 1 - offset)) & 1).to(torch.uint8)
        bits = torch.cat([bits, torch.zeros(-nbits % 8, dtype=torch.uint8)]).view(-1, 8)
        stream = (bits.long() << (7 - torch.arange(8))).sum(1).to(torch.uint8)
        return stream, nbits, scale

    def decompress(self, payload, out):
        stream, nbits, scale = payload
        bits = ((stream.view(-1, 1).long() >> (7 - torch.arange(8))) & 1).view(-1)[:nbits]
        positions = torch.arange(nbits)
        ones = bits.nonzero().squeeze(1)
        first_one = ones[torch.searchsorted(ones, positions).clamp(max=ones.numel() - 1)]
        zeros = (first_one - positions).clamp(0, 5)
        b = (windows(bits, 6)[first_one] >> (5 - zeros)).clamp(1, 32)
        head = 2 * zeros + 1
        low = windows(bits, 32)[(positions + head).clamp(max=nbits)] >> (33 - b)
        value = torch.cat([(1 << (b - 1)) | low, torch.zeros(1, dtype=torch.int64)])
        length = torch.cat([head + b - 1, torch.zeros(1, dtype=torch.int64)])
        # an entry at p: delta(gap), sign, delta(q); follow the entries by pointer doubling
        q_at = (positions + length[:-1] + 1).clamp(max=nbits)
        jump = torch.cat([(q_at + length[q_at]).clamp(max=nbits), torch.tensor([nbits])])
        on = torch.zeros(nbits + 1, dtype=torch.bool)
        on[0] = True
        while True:
            reached = on.clone()
            reached[jump[on]] = True
            if torch.equal(reached, on):
                break
            on, jump = reached, jump[jump]
        starts = on[:-1].nonzero().squeeze(1)
        index = torch.cumsum(value[starts], 0) - 1
        q = value[q_at[starts]].double()
        signs = 1.0 - 2.0 * bits[(starts + length[starts]).clamp(max=nbits - 1)].double()
        out.zero_()
        out[index] = (signs * q * scale / self.s).to(out.dtype)
        return out


def payload_nbytes(payload) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return sum(payload_nbytes(p) for p in payload if isinstance(p, torch.Tensor))


def measure(codec, x, out, runs, copy=None):
    """Median compress and decompress times after one warm-up of each, with ``copy``
    (if given) timed before each compress and each decompress; returns (copy median or
    None, compress, decompress, payload)."""
    holder = {"p": codec.compress(x)}
    codec.decompress(holder["p"], out=out)
    times: dict[str, list[float]] = {"copy": [], "compress": [], "decompress": []}

    def timed(name, fn):
        if fn is None:
            return
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)

    def compress():
        holder["p"] = codec.compress(x)

    for _ in range(runs):
        timed("copy", copy)
        timed("compress", compress)
        timed("copy", copy)
        timed("decompress", lambda: codec.decompress(holder["p"], out=out))
    copy_time = statistics.median(times["copy"]) if copy else None
    return (copy_time, statistics.median(times["compress"]),
            statistics.median(times["decompress"]), holder["p"])


def measure_alternating(codec, baseline, x, out, runs):
    """Median compress and decompress times of ``codec`` and ``baseline``, run by turns
    (a busy host slows both alike): ((compress, decompress), (compress, decompress))."""
    times: dict[str, list[float]] = {}
    for _ in range(runs + 1):  # the first round warms up
        for name, c in (("a", codec), ("b", baseline)):
            start = time.perf_counter()
            payload = c.compress(x)
            middle = time.perf_counter()
            c.decompress(payload, out=out)
            end = time.perf_counter()
            times.setdefault(name + "c", []).append(middle - start)
            times.setdefault(name + "d", []).append(end - middle)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return (med["ac"], med["ad"]), (med["bc"], med["bd"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--torch-runs", type=int, default=3, help="0: skip the torch baselines")
    parser.add_argument("--only", help="run only the compressors whose name starts with this "
                        "(e.g. dithering), for A/B runs against another commit")
    args = parser.parse_args()
    n = args.numel - args.numel % 32
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    source, target = x.numpy(), np.empty_like(x.numpy())
    copy_time = median_time(lambda: np.copyto(target, source), args.runs, warmup=2)
    copy_gbs = nbytes / copy_time / 1e9
    k = max(1, int(0.01 * n))
    cases = [
        ("onebit (scaling)", {"compressor": "onebit", "scaling": True}, TorchOneBit()),
        ("topk (k=1%)", {"compressor": "topk", "k": 0.01}, TorchTopK(k)),
        ("randomk (k=1%)", {"compressor": "randomk", "k": 0.01}, TorchRandomK(k)),
        ("dithering (s=4)", {"compressor": "dithering", "k": 4}, TorchDithering(4)),
        ("bytegrad (chunk=1024)", {"compressor": "bytegrad"}, TorchByteGrad(1024)),
    ]
    benched = {case[1]["compressor"] for case in cases}
    for name in registered_names():  # the others with their typical options, no baseline
        told = description(name)
        if name not in benched and not told.payloads_sum:
            cases.append((f"{name} ({told.label})", {"compressor": name, **told.defaults},
                          None))
    side = int(n ** 0.5)  # powersgd: the square matrix of about n elements
    for rank in (1, 2, 4):
        cases.append((f"powersgd (rank {rank}, {side}x{side})",
                      OneWorkerPowerSGD((side, side), rank), TorchPowerSGD((side, side), rank)))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{n} float32 elements ({nbytes / 2**20:.0f} MiB); np.copyto: {copy_time * 1e3:.1f} ms "
          f"= {copy_gbs:.2f} GB/s; torch threads: {torch.get_num_threads()}; {started}, "
          f"load average {os.getloadavg()[0]:.1f} (the machine's other jobs skew all figures)\n")
    print("| compressor | compress ms | decompress ms | GB/s | copy ms | x copy | torch ms "
          "| torch GB/s | x torch | compression ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cases = [case for case in cases if not args.only or case[0].startswith(args.only)]
    for name, params, baseline in cases:
        data, into, size = x, out, nbytes
        if isinstance(params, dict):
            chain = build(params, n)
        else:  # powersgd: a ready codec for a square matrix
            chain = params
            data = x[:side * side].clone()
            into, size = torch.empty_like(data), side * side * 4
        t_copy, t_c, t_d, payload = measure(chain, data, into, args.runs,
                                            lambda: np.copyto(target, source))
        gbs = size / (t_c + t_d) / 1e9
        versus_torch = "| - | - | - "  # --torch-runs 0: no baseline
        rounds = 1 if isinstance(params, dict) else 2  # powersgd: P and Q
        if baseline is None:
            pass
        elif args.torch_runs and not isinstance(params, dict):  # powersgd: by turns
            (t_c, t_d), (b_c, b_d) = measure_alternating(chain, baseline, data, into,
                                                         args.runs)
            gbs = size / (t_c + t_d) / 1e9
        elif args.torch_runs:
            _, b_c, b_d, _ = measure(baseline, data, into, args.torch_runs)
        if args.torch_runs and baseline is not None:
            torch_gbs = size / (b_c + b_d) / 1e9
            versus_torch = (f"| {b_c * 1e3:.1f} + {b_d * 1e3:.1f} | {torch_gbs:.3f} "
                            f"| {gbs / torch_gbs:.1f} ")
        print(f"| {name} | {t_c * 1e3:.1f} | {t_d * 1e3:.1f} | {gbs:.2f} | {t_copy * 1e3:.1f} "
              f"| {t_copy / (t_c + t_d):.2f} "
              f"{versus_torch}"
              f"| {size / payload_nbytes(payload) / rounds:.1f} |",
              flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
