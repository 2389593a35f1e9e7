"""xorshift128+ (docs/compression.md), the RNG of randomk and dithering.

The state is a numpy ``uint64`` array ``[a, b]``, updated in place by the kernels;
every compressor instance starts from ``(seed, seed)``::

    >>> state = new_state(7)
    >>> draws = [int(next_random(state)) for _ in range(2)]   # advances the state

The step is linear over GF(2) on the 128-bit state, so ``jump`` advances a state by any
number of steps in at most 64 matrix-vector products (``jump_table`` holds the
matrices of 2**k steps), letting threads start their chunk of draws at once::

    >>> a, b = jump(np.uint64(7), np.uint64(7), 2, jump_table())  # == after 2 draws

One generator is a serial chain of shifts and xors; ``draw_lanes`` steps LANES
generators (each jumped to the start of its own span of draws) side by side in SIMD
registers, about 4x the draws per second of one.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types, uint64
from numba.core import cgutils
from numba.extending import intrinsic

DEFAULT_SEED = 1  # used when compression_params["seed"] is None (not set by a trainer)
UINT64_MAX_F64 = float(2**64 - 1)  # bernoulli threshold factor, compared in float64


def job_seed(params: dict) -> int:
    """The seed of validated ``params``: the job's, else DEFAULT_SEED.

        >>> job_seed({"seed": None}), job_seed({"seed": 7})
        (1, 7)
    """
    return DEFAULT_SEED if params["seed"] is None else params["seed"]


def new_state(seed: int) -> np.ndarray:
    return np.array([seed, seed], dtype=np.uint64)


@njit(nogil=True, cache=True)
def xorshift_step(a, b):
    """One xorshift128+ step on a state held in registers: returns (a', b', draw).
    ``t=a; s=b; a=s; t^=t<<23; t^=t>>17; t^=s^(s>>26); b=t; draw=t+s``."""
    t = a
    s = b
    t ^= t << uint64(23)
    t ^= t >> uint64(17)
    t ^= s ^ (s >> uint64(26))
    return s, t, t + s


@njit(nogil=True, cache=True)
def next_random(state):
    """One xorshift128+ step on ``state`` (updated in place); returns the draw."""
    state[0], state[1], draw = xorshift_step(state[0], state[1])
    return draw


@njit(nogil=True, cache=True)
def apply_matrix(columns, a, b):
    """The state ``(a, b)`` times a 128x128 GF(2) matrix given by its ``columns``
    (shape (128, 2): column j is the image of state bit j; bits 0-63 are a's)."""
    ra = uint64(0)
    rb = uint64(0)
    for j in range(64):
        if (a >> uint64(j)) & uint64(1):
            ra ^= columns[j, 0]
            rb ^= columns[j, 1]
        if (b >> uint64(j)) & uint64(1):
            ra ^= columns[64 + j, 0]
            rb ^= columns[64 + j, 1]
    return ra, rb


@njit(nogil=True, cache=True)
def power_columns():
    """Columns of the step matrix M^(2**k) for k = 0..63 (shape (64, 128, 2))."""
    table = np.empty((64, 128, 2), dtype=np.uint64)
    for j in range(128):  # M: one step applied to each basis state
        a = uint64(1) << uint64(j) if j < 64 else uint64(0)
        b = uint64(1) << uint64(j - 64) if j >= 64 else uint64(0)
        table[0, j, 0], table[0, j, 1], _ = xorshift_step(a, b)
    for k in range(1, 64):  # M^(2**k) = M^(2**(k-1)) squared
        for j in range(128):
            table[k, j, 0], table[k, j, 1] = apply_matrix(
                table[k - 1], table[k - 1, j, 0], table[k - 1, j, 1])
    return table


_JUMP_TABLE: list = []


def jump_table() -> np.ndarray:
    """The (64, 128, 2) table of ``power_columns``, computed once (~1 ms)."""
    if not _JUMP_TABLE:
        table = power_columns()
        table.setflags(write=False)
        _JUMP_TABLE.append(table)
    return _JUMP_TABLE[0]


@njit(nogil=True, cache=True)
def jump(a, b, distance, table):
    """The state ``(a, b)`` advanced by ``distance`` >= 0 steps, as (a', b')."""
    a = uint64(a)
    b = uint64(b)
    for k in range(64):
        if (uint64(distance) >> uint64(k)) & uint64(1):
            a, b = apply_matrix(table[k], a, b)
    return a, b


VECTOR = 4  # generators per SIMD register (4 x uint64: 256 bits)
LANES = 2 * VECTOR  # generators stepped side by side: two registers hide each other's latency
_I64 = ir.IntType(64)
_I32 = ir.IntType(32)
_V64 = ir.VectorType(_I64, VECTOR)


def _splat(value: int) -> ir.Constant:
    return ir.Constant(_V64, [ir.Constant(_I64, value)] * VECTOR)


def _shuffle_mask(*indices: int) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, VECTOR), [ir.Constant(_I32, i) for i in indices])


def _transpose(builder: ir.IRBuilder, rows: list) -> list:
    """The 4x4 matrix of 4 vectors, transposed (8 shuffles)."""
    even0 = builder.shuffle_vector(rows[0], rows[1], _shuffle_mask(0, 4, 2, 6))
    odd0 = builder.shuffle_vector(rows[0], rows[1], _shuffle_mask(1, 5, 3, 7))
    even1 = builder.shuffle_vector(rows[2], rows[3], _shuffle_mask(0, 4, 2, 6))
    odd1 = builder.shuffle_vector(rows[2], rows[3], _shuffle_mask(1, 5, 3, 7))
    return [builder.shuffle_vector(even0, even1, _shuffle_mask(0, 1, 4, 5)),
            builder.shuffle_vector(odd0, odd1, _shuffle_mask(0, 1, 4, 5)),
            builder.shuffle_vector(even0, even1, _shuffle_mask(2, 3, 6, 7)),
            builder.shuffle_vector(odd0, odd1, _shuffle_mask(2, 3, 6, 7))]


@intrinsic
def draw_lanes(typingctx, states, out, blocks):
    """Step LANES generators ``4 * blocks`` times: ``out[l, j]`` = generator l's j-th
    draw, and ``states`` (C-contiguous uint64, shape (2, LANES): the a's, then the b's)
    is left at the state after them. ``out`` is C-contiguous uint64 with LANES rows of
    at least ``4 * blocks``.

    Numba does not vectorise the step across generators, so this emits the LLVM vector
    code itself: each block steps each register of 4 generators 4 times, then transposes
    the 4x4 draws so each generator's 4 land next to each other in its row.

    Example::

        >>> @njit
        ... def first_draws(states, out):
        ...     draw_lanes(states, out, 1)
        >>> states = np.full((2, LANES), 7, dtype=np.uint64)
        >>> out = np.empty((LANES, 4), dtype=np.uint64)
        >>> first_draws(states, out)
        >>> a, b, draw = xorshift_step(uint64(7), uint64(7))
        >>> bool(out[3, 0] == draw) and bool(out[3, 1] == xorshift_step(a, b)[2])
        True
    """
    registers = LANES // VECTOR

    def codegen(context, builder, signature, args):
        state_array = context.make_array(signature.args[0])(context, builder, args[0])
        out_array = context.make_array(signature.args[1])(context, builder, args[1])
        row_bytes = cgutils.unpack_tuple(builder, out_array.strides)[0]
        vectors = builder.bitcast(state_array.data, _V64.as_pointer())
        pointers = [builder.gep(vectors, [ir.Constant(_I64, k)]) for k in range(2 * registers)]
        slots = [cgutils.alloca_once_value(builder, builder.load(ptr, align=8))
                 for ptr in pointers]  # promoted to registers by LLVM
        base = builder.bitcast(out_array.data, ir.IntType(8).as_pointer())
        with cgutils.for_range(builder, args[2]) as loop:
            column = builder.mul(loop.index, ir.Constant(_I64, 8 * VECTOR))
            for register in range(registers):
                a, b = builder.load(slots[register]), builder.load(slots[registers + register])
                draws = []
                for _ in range(VECTOR):  # xorshift128+, as xorshift_step
                    t, s = a, b
                    t = builder.xor(t, builder.shl(t, _splat(23)))
                    t = builder.xor(t, builder.lshr(t, _splat(17)))
                    t = builder.xor(t, builder.xor(s, builder.lshr(s, _splat(26))))
                    a, b = s, t
                    draws.append(builder.add(t, s))
                builder.store(a, slots[register])
                builder.store(b, slots[registers + register])
                for k, row in enumerate(_transpose(builder, draws)):
                    lane = register * VECTOR + k
                    offset = builder.add(builder.mul(row_bytes, ir.Constant(_I64, lane)), column)
                    builder.store(row, builder.bitcast(builder.gep(base, [offset]),
                                                       _V64.as_pointer()), align=8)
        for slot, ptr in zip(slots, pointers, strict=True):
            builder.store(builder.load(slot), ptr, align=8)
        return context.get_dummy_value()

    return types.none(states, out, blocks), codegen


def state_list(state: np.ndarray) -> list:
    return [int(state[0]), int(state[1])]


def load_state_list(owner: object, state: np.ndarray, value: object) -> None:
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64 for v in value)
    )
    if not ok:
        raise ValueError(
            f"{type(owner).__name__} state 'rng' must be a list of two ints in [0, 2**64), "
            f"got {value!r}"
        )
    state[0], state[1] = value


class SeededState:
    """The state of a compressor that draws from its own xorshift128+ state ``self.rng``
    (two uint64): saved as a list of two ints, and put back by :meth:`rollback` to what
    it was before the last ``compress``, which keeps that in ``self.undo``::

        class RandomK(SeededState, SparseCompressor): ...
    """

    rng: np.ndarray
    undo: np.ndarray | None = None

    def state_dict(self) -> dict:
        return {"rng": state_list(self.rng)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"rng"}:
            name = type(self).__name__.removesuffix("Torch")
            raise ValueError(f"{name} state must be a dict with key 'rng', got {state!r}")
        load_state_list(self, self.rng, state["rng"])
        self.undo = None

    def rollback(self) -> None:
        """The RNG state before the last ``compress``."""
        if self.undo is not None:
            self.rng[:] = self.undo
            self.undo = None


class SeededStaged:
    """:class:`SeededState` under the staged protocol of device chains: ``encode`` leaves
    the state after its draws in ``self.pending``, ``commit`` makes it current (the one
    before kept for ``rollback``) and ``discard`` drops it. First among a device class's
    bases, before the kernels' protocol::

        class RandomKTorch(SeededStaged, SparseTorchKernels, RandomK): ...
    """

    rng: np.ndarray
    pending: object = None

    def commit(self) -> None:
        self.undo = self.rng.copy()
        self.rng[0], self.rng[1] = self.pending
        self.pending = None

    def discard(self) -> None:
        self.pending = None

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.pending = None
