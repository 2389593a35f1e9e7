"""A compressor's knowledge lives in its class: its keys, their rules and defaults, its
constructor's options and its abilities (protocols). A user class registered with one
call gets the same treatment as the built-in ones."""

import numpy as np
import pytest
import torch

from bps.common.config import Key, real
from bps.compressors import (
    Compressor,
    ErrorFeedback,
    FastErrorUpdate,
    MultiRound,
    ResidualCompress,
    WholeTensor,
    build,
    payload_bound,
    register,
    registered_names,
    supports_device,
    unregister,
    validate_compression_params,
)
from bps.compressors.dithering import Dithering
from bps.compressors.onebit import OneBit
from bps.compressors.powersgd import PowerSGD
from bps.compressors.topk import TopK
from bps.worker.planning import plan_tensor


class Gained(Compressor):
    """float16 values of ``x * gain``; ``gain`` is a key of its own."""

    keys = {"gain": Key(real(0.0), default=1.0)}

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, gain: float = 1.0):
        super().__init__(numel, dtype)
        self.gain = gain

    @classmethod
    def options(cls, params: dict, numel: int) -> dict:
        return {"gain": params["gain"]}

    @classmethod
    def max_payload_bytes(cls, numel: int, dtype: torch.dtype = torch.float32,
                          **options: object) -> int:
        return 2 * numel

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        return (self.check_input(x) * self.gain).half().view(torch.uint8)

    def decompress(self, payload, out=None):
        values = torch.frombuffer(bytearray(bytes(payload)), dtype=torch.float16)
        return self.output(out).copy_(values.float() / self.gain)


@pytest.fixture
def gained():
    register("gained", Gained)
    yield
    unregister("gained")


def test_a_registered_class_validates_and_defaults_its_own_keys(gained):
    assert validate_compression_params({"compressor": "gained"})["gain"] == 1.0
    assert validate_compression_params({"compressor": "gained", "gain": 4})["gain"] == 4.0
    with pytest.raises(TypeError, match=r"'gain'.*'x'.*finite number"):
        validate_compression_params({"compressor": "gained", "gain": "x"})
    with pytest.raises(ValueError, match=r"'gain'.*does not apply to compressor 'topk'.*"
                                         r"only used by compressor 'gained'"):
        validate_compression_params({"compressor": "topk", "k": 3, "gain": 2.0})
    assert validate_compression_params({"compressor": "topk", "k": 3, "gain": 1.0})["k"] == 3
    with pytest.raises(ValueError, match="'k'.*does not apply to compressor 'gained'"):
        validate_compression_params({"compressor": "gained", "k": 3})
    params = validate_compression_params({"compressor": "gained", "gain": 4.0, "ef": "vanilla"})
    assert payload_bound(params, 10) == 20 and not supports_device(params)
    chain = build(params, 4)
    assert isinstance(chain, ErrorFeedback) and chain.inner.gain == 4.0
    chain.set_lr(0.1)
    assert chain.decompress(chain.compress(torch.tensor([1.0, -2.0, 0.5, 0.0]))).tolist() == \
        [1.0, -2.0, 0.5, 0.0]


def test_an_unregistered_class_takes_its_keys_along(gained):
    unregister("gained")
    with pytest.raises(ValueError, match="unknown key.*'gain'"):
        validate_compression_params({"gain": 2.0})
    register("gained", Gained)


def test_a_key_must_not_clash():
    class Shared(Gained):
        keys = {"ef": Key(real(0.0))}

    class OtherDefault(Gained):
        keys = {"k": Key(real(0.0), default=0.5)}

    with pytest.raises(ValueError, match="'ef' is shared"):
        register("shared", Shared)
    with pytest.raises(ValueError, match="'k' defaults to 0.5, compressor 'topk'"):
        register("other", OtherDefault)
    assert "shared" not in registered_names() and "other" not in registered_names()


def test_a_device_twin_is_declared_by_registration(gained):
    class GainedTwin(Gained):
        def __init__(self, numel, dtype=torch.float32, gain=1.0, device=None):
            super().__init__(numel, dtype, gain)

    register("gained_twin", Gained, device=GainedTwin)
    try:
        assert supports_device({"compressor": "gained_twin"})
    finally:
        unregister("gained_twin")


def test_abilities_are_protocols_of_the_built_in_classes():
    powersgd = PowerSGD(6, shape=(3, 2), rank=1)
    assert isinstance(powersgd, MultiRound) and issubclass(PowerSGD, WholeTensor)
    assert isinstance(TopK(4, k=1), FastErrorUpdate) and not isinstance(TopK(4, k=1), MultiRound)
    assert isinstance(Dithering(4, levels=2), ResidualCompress)
    assert not issubclass(OneBit, WholeTensor) and not isinstance(OneBit(4), ResidualCompress)
    assert not isinstance(build({"compressor": "onebit", "ef": "vanilla"}, 4), MultiRound)
    assert build({"compressor": "powersgd", "rank": 1, "ef": "vanilla"}, 6) is not None


class Rows(Gained):
    """A user compressor that takes tensors whole, as rows (a WholeTensor by its methods)."""

    @classmethod
    def tensor_shape(cls, shape, params):
        return None if shape is None or len(shape) < 2 else [shape[0], int(np.prod(shape[1:]))]

    @classmethod
    def batches(cls, params):
        return False


def test_the_planner_asks_the_ability_not_the_name():
    register("rows", Rows)
    try:
        params = validate_compression_params({"compressor": "rows", "min_compress_bytes": 0,
                                              "warmup_steps": 1})
        parts, keys, _ = plan_tensor("w", 4 * 6 * 5, params, torch.float16, 32, (4, 6, 5))
        assert (keys[0].field, keys[0].numel, keys[0].params["shape"]) == \
            ("compressed_key", 120, [4, 30])
        assert parts[0].only == "compressed" and all(p.only == "warmup" for p in parts[1:])
        assert sum(p.length for p in parts[1:]) == 120 and len(parts) == 1 + 120 * 4 // 32
        _, keys, _ = plan_tensor("b", 120, params, torch.float16, 1 << 20, (120,))
        assert [k.field for k in keys] == ["raw_key"]
    finally:
        unregister("rows")
