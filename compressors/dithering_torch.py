"""dithering with torch kernels: quantised on the tensor's device, Elias-delta coded on the host.

The quantiser needs one xorshift128+ draw per element, in index order. The device steps
many generators side by side, each jumped to the start of its span of ``STEPS`` draws:
the host jumps one generator per block of ``SUB`` spans (``rng.jump``), and a GF(2)
matrix product on the device (a float matmul of 0/1 bits, exact) jumps each block's
start to its spans' starts. The levels (one byte per element) and the scale then cross
to the host in one copy (the compress's sync), where dithering.py's coders write the
stream: the payload is a CPU uint8 tensor. Decoding copies the payload to the host,
decodes there and copies the values up; a pulled aggregate, already on the host
(``bps.worker.device_path``), is decoded there and only its values go up
(``decode_upload``).

Bytes are the host's for ``normalize="max"``; with ``"l2"`` the scale is a float64 sum
in torch's order (docs/compression.md). The status is known on the host after the copy;
a chain with error feedback or momentum reads its own flags after it: a second sync.

Example::

    >>> import torch
    >>> c = DitheringTorch(numel=4, levels=2, seed=1, device="cpu")
    >>> c.decompress(c.compress(torch.tensor([0.0, 1.0, -1.0, 0.25])))[:3].tolist()
    [0.0, 1.0, -1.0]
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch
from numba import njit

from .base import KERNEL_FLOAT_DTYPES, Payload
from .device import INPUT_NONFINITE, OK, TorchKernels, to_device_async
from .dithering import TRAILER, Dithering
from .rng import UINT64_MAX_F64, SeededStaged, jump, jump_table

# draws per generator on the device: each is a sequential torch step of 10 kernels, and
# the GF(2) product that jumps the generators to their spans writes 128 counts per
# generator (16 bytes an element at 16 steps, in float16 on a GPU)
STEPS = 16
SUB = 512  # generators per host-jumped block


@njit(nogil=True, cache=True)
def block_starts(a, b, count, distance, table):
    """(count, 2) states: (a, b), then each ``distance`` draws further."""
    out = np.empty((count, 2), dtype=np.uint64)
    for i in range(count):
        out[i, 0] = a
        out[i, 1] = b
        a, b = jump(a, b, distance, table)
    return out


@njit(nogil=True, cache=True)
def span_images(spans, steps, table):
    """(128, spans * 128) 0/1: column 128 j + c is bit c of M^(j * steps) applied to
    basis state bit r (row r; bits 0-63 are a's, 64-127 b's)."""
    out = np.zeros((128, spans * 128), dtype=np.float32)
    for r in range(128):
        a = np.uint64(1) << np.uint64(r) if r < 64 else np.uint64(0)
        b = np.uint64(1) << np.uint64(r - 64) if r >= 64 else np.uint64(0)
        for j in range(spans):
            for c in range(64):
                out[r, 128 * j + c] = (a >> np.uint64(c)) & np.uint64(1)
                out[r, 128 * j + 64 + c] = (b >> np.uint64(c)) & np.uint64(1)
            a, b = jump(a, b, steps, table)
    return out


_IMAGES: dict = {}  # (spans, device) -> span_images there: 32 MB for SUB, shared by chains
_IMAGES_LOCK = threading.Lock()


def shared_images(spans: int, device: torch.device) -> torch.Tensor:
    """``span_images(spans, STEPS)`` on ``device``, made once per process and device."""
    with _IMAGES_LOCK:
        if (spans, device) not in _IMAGES:
            images = torch.from_numpy(span_images(spans, STEPS, jump_table()))
            _IMAGES[spans, device] = images.to(device, count_dtype(device))
        return _IMAGES[spans, device]


def shift_right(t: torch.Tensor, k: int) -> torch.Tensor:
    """The logical right shift of int64 bits."""
    return (t >> k) & ((1 << (64 - k)) - 1)


def count_dtype(device: torch.device) -> torch.dtype:
    """The GF(2) product's float dtype: sums of at most 128 ones are exact in float16
    (a GPU's half-size counts) as in float32 (the CPU's fast matmul)."""
    return torch.float16 if device.type == "cuda" else torch.float32


def unpack_bits(states: torch.Tensor) -> torch.Tensor:
    """(count, 128) float 0/1 of (count, 2) int64 states (a's bits, then b's)."""
    shifts = torch.arange(64, device=states.device)
    bits = ((states.unsqueeze(-1) >> shifts) & 1).reshape(-1, 128)
    return bits.to(count_dtype(states.device))


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(count, 2) int64 states of (count, 128) 0/1 uint8 bits: 8 bits to a byte (bit k of
    a little-endian int64 is bit k % 8 of its byte k // 8), the bytes viewed as int64."""
    weights = torch.ones(8, dtype=torch.uint8, device=bits.device) << torch.arange(
        8, dtype=torch.uint8, device=bits.device)
    packed = (bits.view(-1, 16, 8) * weights).sum(-1, dtype=torch.uint8)
    return packed.view(torch.int64)


def draw_all(blocks: torch.Tensor, images: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` draws (int64 bits of the uint64s) from the generators that
    start at ``blocks`` (host-jumped, one per SUB spans) and ``images`` (span_images)."""
    counts = unpack_bits(blocks) @ images  # GF(2): the parity of each sum is the bit
    states = pack_bits(counts.to(torch.uint8) & 1)  # counts <= 128
    a, b = states[:, 0], states[:, 1]
    draws = torch.empty((STEPS, a.numel()), dtype=torch.int64, device=a.device)
    for j in range(STEPS):  # xorshift128+, as rng.xorshift_step: 10 kernels
        t = a ^ (a << 23)
        t ^= shift_right(t, 17)
        t ^= b ^ shift_right(b, 26)
        torch.add(t, b, out=draws[j])
        a, b = b, t
    return draws.t().reshape(-1)[:numel]  # generator by generator, in index order


def as_float64(draws: torch.Tensor) -> torch.Tensor:
    """uint64 draws (as int64 bits) rounded to float64 once, as numba converts them."""
    high = shift_right(draws, 32).double() * 4294967296.0
    return high + (draws & 0xFFFFFFFF).double()


def quantise(values: torch.Tensor, scale: torch.Tensor, divisor: float, natural: bool,
             draws: torch.Tensor) -> torch.Tensor:
    """The signed levels (int64) of float32/float64 ``values``, as
    dithering_quantiser.quantise_block computes them."""
    r = as_float64(draws)
    magnitude = values.double().abs()
    if natural:
        u = magnitude / scale * divisor
        ceiling = torch.ceil(u)
        exponent = torch.frexp(ceiling - 1).exponent.to(torch.int64)  # bit_length(v - 1)
        pow2 = torch.where(ceiling <= 1, ceiling.to(torch.int64), 1 << exponent)
        f = pow2 >> 1
        length = torch.clamp_min(f, 1).double()
        up = r < (u - f.double()) / length * UINT64_MAX_F64
        q = f + length.to(torch.int64) * up.to(torch.int64)
    else:
        u = (magnitude / scale * divisor).float()
        low = torch.floor(u)
        up = r < (u - low).double() * UINT64_MAX_F64
        q = low.to(torch.int64) + up.to(torch.int64)
    return torch.where(values < 0, -q, q)


class DeviceDraws:
    """A key's uniform draws on its device from its xorshift128+ state: ``sub``
    generators a block of ``sub * STEPS`` elements, each block's start jumped to on the
    host, the jump images shared by keys (made at the first draw)::

        draws = DeviceDraws(numel, device)
        uniforms = draws(compressor.rng)   # float64, numel of them
    """

    def __init__(self, numel: int, device: torch.device) -> None:
        spans = -(-numel // STEPS)
        self.numel, self.device = numel, device
        self.sub = min(SUB, spans)
        self.block_count = -(-spans // self.sub)
        self.images: torch.Tensor | None = None

    def __call__(self, rng: np.ndarray) -> torch.Tensor:
        if self.images is None:
            self.images = shared_images(self.sub, self.device)
        a, b = rng
        blocks = block_starts(a, b, self.block_count, self.sub * STEPS, jump_table())
        return draw_all(to_device_async(blocks.view(np.int64), self.device), self.images,
                        self.numel)


class DitheringTorch(SeededStaged, TorchKernels, Dithering):
    """Dithering quantised on ``device`` (payload on the host, see the module docstring)."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, levels: int = 2,
                 natural: bool = False, l2: bool = False, seed: int = 1,
                 device: torch.device | str | None = None):
        Dithering.__init__(self, numel, dtype, levels, natural, l2, seed)
        TorchKernels.__init__(self, numel, dtype, device)
        self.draws = DeviceDraws(numel, self.device)

    def _levels(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        levels = quantise(values, scale, self.divisor, self.natural, self.draws(self.rng))
        return torch.where(scale > 0, levels, 0)  # scale 0: every level is 0

    def _encode(self, x: torch.Tensor) -> tuple:
        values = x if x.dtype in KERNEL_FLOAT_DTYPES else x.float()
        if self.l2:
            scale = values.double().square().sum().sqrt()
        else:
            scale = values.abs().amax().double()
        levels = self._levels(values, scale)
        level_bytes = levels.to(_TORCH_INT[self.level_dtype]).view(torch.uint8)
        host = torch.cat([level_bytes, scale.reshape(1).view(torch.uint8)]).cpu().numpy()
        scale_value = float(host[-8:].view(np.float64)[0])
        if not math.isfinite(scale_value):
            return None, torch.tensor([INPUT_NONFINITE, -1]), levels, scale_value
        payload = torch.empty(self.max_stream_bytes + TRAILER, dtype=torch.uint8)
        words = payload.numpy()[: payload.numel() // 4 * 4].view(np.uint32)
        level_array = host[:-8].view(self.level_dtype)
        nbits = self.code_levels(level_array, words) if scale_value > 0.0 else 0
        self.pending = jump(self.rng[0], self.rng[1], self.numel, jump_table())
        payload = self.finish(payload, nbits, scale_value)
        return payload, torch.tensor([OK, -1]), levels, scale_value

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, _, _ = self._encode(self.check_input(x))
        return payload, status

    def encode_residual(self, corrected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        payload, status, levels, scale = self._encode(corrected)
        if payload is not None:
            corrected.sub_(self.decoded(levels, scale))
        return payload, status

    def decoded(self, levels: torch.Tensor, scale: float) -> torch.Tensor:
        """What error feedback subtracts for ``levels``, rounded as the host chain's
        residual rounds it (dithering.compress_residual)."""
        if (self.dtype in KERNEL_FLOAT_DTYPES and self.level_dtype == np.int8
                and self.divisor_pow2):
            return (levels.double() * (scale / self.divisor)).to(self.dtype)
        magnitude = levels.abs().double() * scale / self.divisor
        if self.dtype in KERNEL_FLOAT_DTYPES:
            magnitude = magnitude.to(self.dtype)
        else:  # decoded to float32, then rounded to the dtype
            magnitude = magnitude.float().to(self.dtype)
        return torch.where(levels < 0, -magnitude, magnitude)

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        """Decoded on the host (the stream is sequential), the values copied up."""
        if isinstance(payload, torch.Tensor) and payload.device != self.device:
            raise ValueError(f"payload tensor must be on {self.device}, got {payload.device}")
        if isinstance(payload, torch.Tensor):
            payload = payload.cpu()
        out = self.output(out)
        return out.copy_(to_device_async(self._host_decoded(payload), self.device))

    def _host_decoded(self, payload: Payload) -> torch.Tensor:
        """The host decoder's values (a CPU tensor of the chain's dtype), with its checks."""
        device, self.device = self.device, torch.device("cpu")
        try:
            return Dithering.decompress(self, payload)
        finally:
            self.device = device

    def decode_key(self, payload: np.ndarray) -> tuple:
        return ()  # the host decoder checks it in decode_upload, decoding it

    def decode_upload(self, payload: np.ndarray) -> np.ndarray:
        """What goes up for :meth:`decode_checked`: a pulled aggregate, whose bytes are on
        the host, decoded there (the host decoder's checks and errors), as raw bytes."""
        return self._host_decoded(payload).view(torch.uint8).numpy()

    def decode_checked(self, payload: torch.Tensor, key: tuple) -> torch.Tensor:
        """:meth:`decode_upload`'s values, on the device (a copy: ``payload`` is the key's
        upload buffer, which its next decode overwrites)."""
        return payload.view(self.dtype).clone()



_TORCH_INT = {np.int8: torch.int8, np.int32: torch.int32, np.int64: torch.int64}
