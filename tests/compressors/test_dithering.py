"""dithering's parallel paths (chunked encode, speculative decode) and the RNG jump,
against the sequential references, on inputs small enough for the Python reference:
the thresholds that switch those paths on are lowered by the ``small_chunks`` fixture."""

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from numba import njit

from bps.compressors import (
    build,
    dithering_decoder,
    dithering_quantiser,
    elias_delta,
    threads,
)
from bps.compressors.rng import LANES, draw_lanes, jump, jump_table
from tests.harness import reference_compressors as ref
from tests.harness.samples import (
    DTYPES,
    FAST,
    as_values,
    dtypes,
    payload_of,
    sample,
    sizes,
)


@pytest.fixture
def small_chunks(monkeypatch):
    """4 chunks from 256 elements on, 4 lanes per chunk from 32, decode split from 64 bits."""
    monkeypatch.setattr(threads, "MIN_CHUNK", 256)
    monkeypatch.setattr(threads, "THREADS", 4)
    monkeypatch.setattr(dithering_quantiser, "LANE_MIN", 32)
    monkeypatch.setattr(dithering_decoder, "MIN_SPLIT_BITS", 64)


def test_jump_matches_sequential_steps():
    for seed in (1, 2**64 - 1, 12345):
        rng = ref.XorShift128Plus(seed)
        done = 0
        for distance in (0, 1, 2, 3, 64, 1000, 4097):
            for _ in range(distance - done):
                rng.next()
            done = distance
            a, b = jump(np.uint64(seed), np.uint64(seed), distance, jump_table())
            assert (int(a), int(b)) == (rng.a, rng.b)


def test_draw_lanes_steps_each_generator_from_its_own_state():
    seeds = [1, 2, 3, 2**64 - 1, 12345, 7, 9, 2**63]
    references = [ref.XorShift128Plus(seed) for seed in seeds]
    states = np.array([seeds, seeds], dtype=np.uint64)
    out = np.zeros((LANES, 64), dtype=np.uint64)

    @njit
    def draw(states, out, blocks):
        draw_lanes(states, out, blocks)

    for blocks in (3, 1, 16):  # the states carry over from call to call
        draw(states, out, blocks)
        for lane, reference in enumerate(references):
            assert out[lane, : 4 * blocks].tolist() == [reference.next()
                                                        for _ in range(4 * blocks)]
            assert states[:, lane].tolist() == [reference.a, reference.b]
        assert not out[:, 4 * blocks :].any()  # nothing written past the blocks
        out[:] = 0


def test_quantiser_refuses_a_states_array_draw_lanes_would_overrun():
    x = np.ones(1024, np.float32)
    levels = np.zeros(1024, np.int8)
    for states in (np.zeros((LANES, 2), np.uint64), np.zeros((2, 2 * LANES), np.uint64)[:, ::2]):
        with pytest.raises(ValueError, match="states"):
            dithering_quantiser.quantise_chunk(x, 1.0, 4.0, False, 128, states,
                                               np.empty(0, np.float32), 0.0, levels)


def reference_stream(levels: np.ndarray) -> tuple[bytes, int]:
    """The stream bytes and bit count of signed levels, written from docs/compression.md."""
    bits, previous = [], -1
    for i, level in enumerate(levels.tolist()):
        if level:
            bits += [ref.elias_delta(i - previous), "1" if level < 0 else "0",
                     ref.elias_delta(abs(level))]
            previous = i
    stream = "".join(bits)
    padded = stream + "0" * (-len(stream) % 8)
    return bytes(int(padded[j : j + 8], 2) for j in range(0, len(padded), 8)), len(stream)


def test_table_codes_built_in_python_match_the_kernel_codes():
    """The tables are built at import with a plain-Python Elias-delta code; it must equal
    the kernels' own ``delta_code`` for every value the coder can meet."""
    from bps.compressors.bitstream import delta_code

    values = list(range(1, 1 << 16)) + [(1 << b) + d for b in range(16, 32) for d in (-1, 0, 1)]
    drawn = np.random.default_rng(3).integers(1, 1 << 32, 2000)
    values += [(1 << 32) - 1] + [int(v) for v in drawn]
    for v in values:
        code, length = delta_code(v)
        assert elias_delta.delta_bits(v) == int(code), v
        assert elias_delta.delta_length(v) == int(length), v


def test_window_coder_codes_every_pattern_after_any_gap():
    """Every window of 4 levels the table covers (-3..4 each), each after a gap drawn from
    1..40 (zero windows in between), windows with levels outside it (slow path), windows
    whose code with its gap passes 32 bits, a gap past 2**16 and a tail that is not a
    whole window: the same bits as the reference, and the same as ``code_chunk``."""
    gen = np.random.default_rng(5)
    patterns = [[((p >> (3 * k)) & 7) - 3 for k in range(4)] for p in range(4096)]
    patterns += [[5, 0, -4, 1], [-9, 100, -128, 127], [4, 4, 4, 4], [-3, 4, -3, 4]]
    pieces = []
    for pattern in gen.permutation(np.array(patterns)):
        pieces += [[0] * (4 * int(gen.integers(0, 10))), list(pattern)]
    pieces += [[0] * (1 << 17), [1, 0, 0, -1, 0, 0, 4, 4, 4, 4, 3, 0, 0, 2, 2]]
    levels = [v for piece in pieces for v in piece]
    for ones in range(64):  # 35-bit windows (gap 9 or 13, four 4s) at every bit offset
        levels += [1] * ones
        levels += [0] * (-len(levels) % 4 + 8 + 4 * (ones % 2)) + [4, 4, 4, 4]
    levels = np.array(levels + [0, -2, 0, 0, 3], dtype=np.int8)
    for start in (0, 1, 3):  # windows at every offset from the reference's nonzeros
        chunk = levels[start:]
        expected, nbits = reference_stream(chunk)
        words = np.zeros(chunk.size, dtype=np.uint32)
        windows = chunk[: chunk.size // 4 * 4].view(np.uint32)
        result = elias_delta.code_windows(chunk, windows, elias_delta.WINDOW_CODES,
                                        elias_delta.GAP_CODES, elias_delta.SMALL_CODES, words)
        nonzero = np.flatnonzero(chunk)
        assert result == (nbits, nonzero[0], nonzero[-1])
        assert words.view(np.uint8)[: len(expected)].tobytes() == expected
        words_chunk = np.zeros(chunk.size, dtype=np.uint32)
        assert elias_delta.code_chunk(chunk, elias_delta.SMALL_CODES, words_chunk) == result
        np.testing.assert_array_equal(words_chunk, words)


def gradient(numel: int, seed: int) -> np.ndarray:
    """Normal values with zero runs across chunk bounds, one all-zero chunk and
    nonzero values on the bounds."""
    gen = np.random.default_rng(seed)
    x = gen.standard_normal(numel)
    x[250:270] = 0.0  # a run across the first bound
    x[512:768] = 0.0  # a whole chunk
    x[gen.random(numel) < 0.3] = 0.0
    x[[255, 256, 767, 768, 1023, 1024]] = [1.5, -2.0, 0.7, -0.9, 3.0, -3.0]
    return x.astype(np.float32)


CASES = [(4, "linear", "max"), (2, "linear", "l2"), (127, "linear", "max"),
         (3, "natural", "max"), (8, "natural", "l2")]


@pytest.mark.parametrize("s, partition, normalize", CASES)
@pytest.mark.parametrize("numel", [1100, 1543])
def test_chunked_encode_and_speculative_decode_match_reference(small_chunks, s, partition,
                                                                normalize, numel):
    params = {"compressor": "dithering", "k": s, "partition": partition,
              "normalize": normalize, "seed": 7}
    c = build(params, numel)
    assert len(c.bounds) == 4
    rng = ref.XorShift128Plus(7)
    for step in range(2):
        x = gradient(numel, step)
        payload = c.compress(torch.from_numpy(x)).numpy().tobytes()
        scale = float(np.frombuffer(payload[-8:], "<f8")[0])
        expected = ref.dithering_encode(x.astype(np.float64), s, partition, normalize, rng,
                                        scale=scale)
        assert payload == expected
        assert c.state_dict() == {"rng": [rng.a, rng.b]}
        decoded = ref.round_to(ref.dithering_decode(payload, numel, s, partition), "float32")
        out = torch.full((numel,), 9.0)
        np.testing.assert_array_equal(c.decompress(payload, out=out).numpy(), decoded)


@pytest.mark.parametrize("s, partition", [(4, "linear"), (3, "natural"), (126, "linear"),
                                          (127, "linear")])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_compress_residual_leaves_the_input_minus_the_decoded_payload(small_chunks, s,
                                                                       partition, dtype):
    # error feedback's e = g' - D(c): in the quantiser's pass for float32/float64 and
    # levels up to 127 (s = 126), chunk by chunk; by decoding for wider levels or
    # float16; all against the reference decoder, and the payload is compress()'s
    numel = 1543
    params = {"compressor": "dithering", "k": s, "partition": partition, "seed": 7}
    fused = build(params, numel, ref.TORCH_DTYPE[dtype])
    plain = build(params, numel, ref.TORCH_DTYPE[dtype])
    assert len(fused.bounds) == 4

    def expected(x: np.ndarray, payload: torch.Tensor) -> np.ndarray:
        decoded = ref.dithering_decode(payload.numpy().tobytes(), numel, s, partition)
        if dtype == "float16":  # torch's float16 ops compute in float32, then round
            return (x.astype(np.float32) - ref.round_to(decoded, dtype).astype(np.float32)
                    ).astype(dtype)
        return (x - ref.round_to(decoded, dtype)).astype(dtype)

    for step in range(3):
        x = gradient(numel, step).astype(dtype)
        residual = torch.from_numpy(x.copy())
        payload = fused.compress_residual(residual)
        assert torch.equal(payload, plain.compress(torch.from_numpy(x)))
        np.testing.assert_array_equal(residual.numpy(), expected(x, payload))
    zeros = torch.zeros(numel, dtype=ref.TORCH_DTYPE[dtype])
    payload = fused.compress_residual(zeros)
    assert torch.equal(zeros, torch.zeros(numel, dtype=ref.TORCH_DTYPE[dtype]))
    assert torch.equal(payload, plain.compress(zeros))


@pytest.mark.parametrize("s, partition", [(4, "linear"), (2, "natural"), (6, "linear")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_residual_is_exact_at_any_magnitude(s, partition, dtype):
    # power-of-two divisors (s = 4; natural) take the residual as level * (scale /
    # divisor), others from a table of decoded levels: both must equal the decoder's
    # values bit for bit, also for tiny, huge and subnormal float32 scales
    numel = 3000
    c = build({"compressor": "dithering", "k": s, "partition": partition, "seed": 4}, numel,
              ref.TORCH_DTYPE[dtype])
    for magnitude in (1e-44, 1e-30, 3e-3, 1.0, 7e12, 1e36):
        x = (gradient(numel, 5) * magnitude).astype(dtype)
        residual = torch.from_numpy(x.copy())
        payload = c.compress_residual(residual)
        decoded = ref.round_to(ref.dithering_decode(payload.numpy().tobytes(), numel, s,
                                                    partition), dtype)
        np.testing.assert_array_equal(residual.numpy(), (x - decoded).astype(dtype),
                                      err_msg=f"magnitude {magnitude}")


def test_compress_residual_refuses_inf_and_loses_nothing(small_chunks):
    c = build({"compressor": "dithering", "k": 4, "seed": 3}, 1200)
    x = torch.ones(1200)
    x[700] = float("inf")
    kept, state = x.clone(), c.state_dict()
    with pytest.raises(ValueError, match="inf or NaN"):
        c.compress_residual(x)
    assert torch.equal(x, kept) and c.state_dict() == state


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
@pytest.mark.parametrize("normalize", ["max", "l2"])
def test_inf_or_nan_anywhere_is_refused(small_chunks, dtype, normalize):
    c = build({"compressor": "dithering", "k": 4, "normalize": normalize, "seed": 3}, 1200,
              ref.TORCH_DTYPE[dtype])
    for bad in (np.nan, -np.inf, np.inf):
        for at in (0, 700, 1199):  # in the first chunk, a later one, the last element
            x = torch.ones(1200, dtype=ref.TORCH_DTYPE[dtype]) * 2.0
            x[at] = float(bad)
            with pytest.raises(ValueError, match="inf or NaN"):
                c.compress(x)
    x = torch.tensor(gradient(1200, 3), dtype=ref.TORCH_DTYPE[dtype]).double().numpy()
    payload = c.compress(torch.tensor(x, dtype=ref.TORCH_DTYPE[dtype])).numpy().tobytes()
    scale = float(np.frombuffer(payload[-8:], "<f8")[0])
    if normalize == "max":
        assert scale == np.abs(x).max()
    # the refusals left the generator where it was: the payload of a fresh one
    assert payload == ref.dithering_encode(x, 4, "linear", normalize, ref.XorShift128Plus(3),
                                           scale=scale)


def test_all_zero_and_one_nonzero_inputs(small_chunks):
    c = build({"compressor": "dithering", "k": 4, "seed": 3}, 1200)
    rng = ref.XorShift128Plus(3)
    for x in (np.zeros(1200, np.float32), np.eye(1, 1200, 900, dtype=np.float32)[0]):
        payload = c.compress(torch.from_numpy(x)).numpy().tobytes()
        assert payload == ref.dithering_encode(x.astype(np.float64), 4, "linear", "max", rng)
        assert torch.equal(c.decompress(payload), torch.from_numpy(x))
        assert c.state_dict() == {"rng": [rng.a, rng.b]}


def test_failed_speculation_falls_back_to_the_sequential_parse(small_chunks, monkeypatch):
    numel = 1543
    c = build({"compressor": "dithering", "k": 4, "seed": 5}, numel)
    payload = c.compress(torch.from_numpy(gradient(numel, 1)))
    expected = c.decompress(payload).clone()
    speculate = dithering_decoder.speculate
    calls = []

    def failing(*args):  # an error, then parses that never meet the true one
        error, position, index, count = speculate(*args)
        args[-1][0, :count] += 1  # shift the recorded entry starts off the true ones
        calls.append(args[2])
        return (1 if len(calls) == 1 else error), position, index, count

    monkeypatch.setattr(dithering_decoder, "speculate", failing)
    for _ in range(2):
        assert torch.equal(c.decompress(payload), expected)
    assert len(calls) == 6


def test_split_decode_keeps_one_scratch_array_per_range(small_chunks):
    """Streams of different lengths cut at different bits: the speculative ranges'
    scratch arrays are made once per range and reused, not once per cut (which grew the
    compressor by a numel-sized array with nearly every payload)."""
    numel = 1543
    c = build({"compressor": "dithering", "k": 4, "seed": 5}, numel)
    lengths = set()
    for step in range(12):
        x = gradient(numel, step)
        x[: 100 * step] = 0.0  # a different stream length each step
        payload = c.compress(torch.from_numpy(x))
        lengths.add(payload.numel())
        assert torch.equal(c.decompress(payload), c.decompress(payload.clone()))
    assert len(lengths) > 8
    scratch = sorted(name for name in c.buffers if name.startswith(("scratch", "marks")))
    assert scratch == ["marks1", "marks2", "marks3", "scratch1", "scratch2", "scratch3"]


def test_splice_appends_a_gap_code_and_any_bit_range_at_any_bit():
    """splice_chunk against bit strings: every destination and source alignment, ranges
    shorter and longer than a word, and bits of the destination's word before it kept."""
    gen = np.random.default_rng(4)

    def bits_of(words: np.ndarray) -> str:  # uint32 words in stream byte order
        return "".join(format(byte, "08b") for byte in words.view(np.uint8).tolist())

    for dst_bit in range(0, 70, 3):
        for src_bit in range(0, 40, 5):
            for nbits in (0, 1, 31, 32, 33, 64, 95, 200):
                src = gen.integers(0, 2**32, 12, dtype=np.uint32)
                dst = gen.integers(0, 2**32, 16, dtype=np.uint32)
                before = bits_of(dst)[:dst_bit]
                gap = int(gen.integers(1, 3000))
                end = elias_delta.splice_chunk(dst, dst_bit, gap, src, src_bit, nbits)
                expected = before + ref.elias_delta(gap) + bits_of(src)[src_bit:src_bit + nbits]
                assert end == len(expected)
                padded = expected + "0" * (-len(expected) % 32)
                assert bits_of(dst)[:len(padded)] == padded


def test_speculation_from_every_bit_offset(small_chunks):
    """A parse started at any bit, once it meets the true parse, decodes the same."""
    numel = 1543
    c = build({"compressor": "dithering", "k": 4, "seed": 5}, numel)
    payload = c.compress(torch.from_numpy(gradient(numel, 2))).numpy()
    words, nbits, scale = stream_words(payload)
    args = c.decode_args(scale)
    truth = np.zeros(numel, np.float32)
    error, _, last, _ = dithering_decoder.decode_entries(
        words, nbits, 0, -1, nbits, dithering_decoder.NO_SYNC, *args, truth,
        dithering_decoder.NO_MARKS)
    assert error == 0
    met = 0
    for start in range(0, nbits, 7):
        scratch = np.full(numel, 5.0, np.float32)
        marks = np.zeros((2, dithering_decoder.MARKS), np.int64)
        error, end, rel_last, count = dithering_decoder.speculate(words, nbits, start, nbits, *args,
                                                          scratch, marks)
        out = np.full(numel, 5.0, np.float32)
        error2, position, index, hit = dithering_decoder.decode_entries(
            words, nbits, 0, -1, nbits, marks[0, :count], *args, out, dithering_decoder.NO_MARKS)
        assert error2 == 0
        if error or not hit:
            continue
        met += 1
        offset = index - marks[1, hit - 1]
        assert rel_last + offset == last and end == nbits
        np.testing.assert_array_equal(scratch[marks[1, hit - 1] + 1 : rel_last + 1],
                                      truth[index + 1 : last + 1])
    assert met > nbits // 7 * 0.9


def stream_words(payload: np.ndarray) -> tuple[np.ndarray, int, float]:
    """The decoder's input: the payload's bytes viewed as uint64, its bits, scale."""
    words = payload[: len(payload) // 8 * 8].copy().view(np.uint64)
    return words, int(payload[-16:-8].view("<u8")[0]), float(payload[-8:].view("<f8")[0])


def entry_starts(payload: np.ndarray) -> list[int]:
    """The bit position of every entry, parsed in Python from docs/compression.md."""
    nbits = int(payload[-16:-8].view("<u8")[0])
    stream = "".join(format(byte, "08b") for byte in payload[:-16].tolist())[:nbits]
    starts, pos = [], 0

    def skip_delta(pos: int) -> int:
        zeros = stream.index("1", pos) - pos
        b = int(stream[pos + zeros : pos + 2 * zeros + 1], 2)
        return pos + 2 * zeros + 1 + b - 1

    while pos < nbits:
        starts.append(pos)
        pos = skip_delta(skip_delta(pos) + 1)
    return starts


def test_decode_stops_at_most_one_entry_past_stop():
    """``decode_entries`` with ``stop``: it ends at the first entry start >= stop or (two
    entries per lookup) the one after: the threads' ranges rely on it."""
    numel = 20000
    c = build({"compressor": "dithering", "k": 4, "seed": 5}, numel)
    payload = c.compress(torch.from_numpy(gradient(numel, 3))).numpy()
    words, nbits, scale = stream_words(payload)
    starts = entry_starts(payload)
    for stop in range(1, nbits, 97):
        out = np.zeros(numel, np.float32)
        error, position, _, _ = dithering_decoder.decode_entries(
            words, nbits, 0, -1, stop, dithering_decoder.NO_SYNC, *c.decode_args(scale), out,
            dithering_decoder.NO_MARKS)
        first = next(k for k, start in enumerate(starts + [nbits]) if start >= stop)
        assert error == 0 and position in (starts + [nbits, nbits])[first : first + 2]


def test_a_stream_cut_inside_its_last_entry_is_refused():
    """The bit count cut by one of the last entry's trailing zero bits: the zero padding
    would complete the entry, yet the stream ends inside it."""
    numel = 20000
    x = gradient(numel, 4)
    x[-300:] = 0.0  # the last entry well before the output's end (the decoder's fast loop)
    c = build({"compressor": "dithering", "k": 4, "seed": 6}, numel)
    cuts = 0
    for _ in range(40):
        payload = c.compress(torch.from_numpy(x)).numpy().copy()
        nbits = int(payload[-16:-8].view("<u8")[0])
        last_bit = (int(payload[(nbits - 1) // 8]) >> (7 - (nbits - 1) % 8)) & 1
        if last_bit or nbits % 8 == 1:  # a 1, or the cut would drop a whole byte
            continue
        assert entry_starts(payload)[-1] < nbits - 1  # so the cut is inside that entry
        payload[-16:-8] = np.array([nbits - 1], dtype="<u8").view(np.uint8)
        with pytest.raises(ValueError, match="truncated Elias-delta|ends inside an entry"):
            c.decompress(torch.from_numpy(payload))
        cuts += 1
    assert cuts >= 5


@pytest.mark.parametrize("name", ["dithering", "natural"])
def test_corrupted_payloads_fail_like_the_sequential_decoder(small_chunks, name):
    params = {"compressor": "dithering", "k": 4} if name == "dithering" else {
        "compressor": "dithering", "k": 5, "partition": "natural"}
    numel = 1543
    chunked = build(params, numel)
    payload = chunked.compress(torch.from_numpy(gradient(numel, 3))).numpy().tobytes()
    gen = np.random.default_rng(0)
    outcomes = set()
    for trial in range(150):
        corrupted = bytearray(payload)
        for _ in range(1 + trial % 3):
            corrupted[gen.integers(0, len(payload) - 16)] = gen.integers(0, 256)
        results = []
        for split in (64, 1 << 40):  # speculative, then sequential (the single-thread path)
            dithering_decoder.MIN_SPLIT_BITS = split
            try:
                results.append(chunked.decompress(bytes(corrupted)).numpy())
            except ValueError as error:
                results.append(str(error))
        dithering_decoder.MIN_SPLIT_BITS = 64
        if isinstance(results[0], str) or isinstance(results[1], str):
            assert results[0] == results[1]
            outcomes.add(results[0].split(": ")[-1])
        else:
            np.testing.assert_array_equal(results[0], results[1])
            outcomes.add("ok")
    assert len(outcomes) >= 3


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("s", [4, 127])
def test_block_bounds_of_the_coder_and_the_decoder(monkeypatch, chunked, s):
    """Past the coder's CODE_BLOCK and the decoder's ZERO_BLOCK (numba freezes both, so
    the input is made large enough): nonzeros on and around the bounds, a gap across
    a whole zero block, and a stretch whose table lookups move 40 elements each (the
    decoder must have zeroed that far ahead)."""
    numel = 4 * dithering_decoder.ZERO_BLOCK + 123
    gen = np.random.default_rng(s)
    x = gen.standard_normal(numel).astype(np.float32)
    x[gen.random(numel) < 0.5] = 0.0
    block, zero = elias_delta.CODE_BLOCK, dithering_decoder.ZERO_BLOCK
    x[block - 40 : block + 90] = 0.0  # a gap across a coder bound
    x[zero - 5 : 2 * zero + 300] = 0.0  # a gap over a whole zero block
    x[[block - 1, block, 2 * block - 1, zero - 1, 2 * zero + 300]] = [2.0, -2.0, 1.0, -1.5, 9.0]
    x[2 * zero + 301 :] = 0.0
    x[2 * zero + 340 :: 40] = 9.0 / 4  # q = 1 exactly for s = 4: 12-bit entries 40 apart
    if chunked:
        monkeypatch.setattr(threads, "MIN_CHUNK", 2048)
        monkeypatch.setattr(threads, "THREADS", 4)
        monkeypatch.setattr(dithering_decoder, "MIN_SPLIT_BITS", 64)
    c = build({"compressor": "dithering", "k": s, "seed": 11}, numel)
    assert (len(c.bounds) > 1) == chunked
    rng = ref.XorShift128Plus(11)
    payload = c.compress(torch.from_numpy(x)).numpy().tobytes()
    assert payload == ref.dithering_encode(x.astype(np.float64), s, "linear", "max", rng)
    decoded = ref.round_to(ref.dithering_decode(payload, numel, s, "linear"), "float32")
    out = torch.full((numel,), 9.0)
    np.testing.assert_array_equal(c.decompress(payload, out=out).numpy(), decoded)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 33, 1000])
@pytest.mark.parametrize("s, partition", [(1, "linear"), (4, "linear"), (127, "linear"),
                                          (1, "natural"), (3, "natural"), (8, "natural")])
@pytest.mark.parametrize("normalize", ["max", "l2"])
def test_dithering_matches_reference(dtype, numel, s, partition, normalize):
    params = {"compressor": "dithering", "k": s, "partition": partition,
              "normalize": normalize, "seed": 42}
    c = build(params, numel, ref.TORCH_DTYPE[dtype])
    rng = ref.XorShift128Plus(42)
    for step in range(2):
        x = sample(numel, dtype, seed=step + numel)
        values = as_values(x)
        payload = payload_of(c.compress(x))
        scale = float(np.frombuffer(payload[-8:], "<f8")[0])
        assert scale == pytest.approx(ref.dithering_scale(values, normalize), rel=1e-13)
        # the float64 sum order of "l2" is the kernel's: feed its scale to the reference
        assert payload == ref.dithering_encode(values, s, partition, normalize, rng, scale=scale)
        nbits = int(np.frombuffer(payload[-16:-8], "<u8")[0])
        assert len(payload) == (nbits + 7) // 8 + 16
        expected = ref.round_to(ref.dithering_decode(payload, numel, s, partition), dtype)
        np.testing.assert_array_equal(as_values(c.decompress(payload)), expected)


def test_dithering_draws_one_number_per_element_even_for_zeros():
    c = build({"compressor": "dithering", "k": 2, "seed": 9}, 50)
    c.compress(torch.zeros(50))
    rng = ref.XorShift128Plus(9)
    for _ in range(50):
        rng.next()
    assert c.state_dict() == {"rng": [rng.a, rng.b]}


@FAST
@given(numel=sizes, dtype=dtypes, s=st.integers(1, 16), natural=st.booleans(),
       l2=st.booleans(), seed=st.integers(1, 2**64 - 1))
@example(numel=523, dtype="bfloat16", s=13, natural=False, l2=False, seed=13)  # a level up
def test_dithering_bounds_and_error(numel, dtype, s, natural, l2, seed):
    params = {"compressor": "dithering", "k": s, "partition": "natural" if natural else "linear",
              "normalize": "l2" if l2 else "max", "seed": seed}
    c = build(params, numel, ref.TORCH_DTYPE[dtype])
    x = sample(numel, dtype, seed=seed % 2**32)
    payload = c.compress(x).numpy().tobytes()
    nbits = int(np.frombuffer(payload[-16:-8], "<u8")[0])
    assert len(payload) == (nbits + 7) // 8 + 16
    y = c.decompress(payload)
    scale = float(np.frombuffer(payload[-8:], "<f8")[0])
    divisor = 2 ** (s - 1) if natural else s
    step = scale / divisor * (2 ** (s - 1) if natural else 1)  # one level (natural: widest)
    err = (y.double() - x.double()).abs().max().item()
    # a level apart at most, plus the decoded value's rounding to the dtype (half an ulp:
    # at most eps / 2 of it; in bfloat16 beside a level 13 apart, more than the 1% slack)
    rounding = torch.finfo(y.dtype).eps / 2 * y.double().abs().max().item()
    assert err <= step * 1.01 + rounding + 1e-30
    assert torch.equal(torch.sign(y[y != 0]), torch.sign(x[y != 0]))
