"""xorshift128+ against the reference generator."""

from tests.harness import reference_compressors as ref


def test_xorshift_first_draws():
    from bps.compressors.rng import new_state, next_random

    rng, state = ref.XorShift128Plus(12345), new_state(12345)
    assert [int(next_random(state)) for _ in range(5)] == [rng.next() for _ in range(5)]
