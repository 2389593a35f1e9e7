"""A step's GradScaler scale is read where it is first needed, once, on any thread."""

from __future__ import annotations

import threading

import torch

from bps.core.loss_scale import LossScale, ScaleReading


class CountingScaler(torch.amp.GradScaler):
    """A real GradScaler (on the CPU) that notes the threads that read its scale."""

    def __init__(self, init_scale: float) -> None:
        super().__init__("cpu", init_scale=init_scale)
        self.readers: list[str] = []

    def get_scale(self) -> float:
        self.readers.append(threading.current_thread().name)
        return super().get_scale()


def test_a_step_start_reads_nothing_and_the_first_use_reads_once():
    scaler = CountingScaler(1024.0)
    reading = ScaleReading()
    reading.start(scaler)  # the first hook of a step
    assert scaler.readers == []
    values = []
    threads = [threading.Thread(target=lambda: values.append(reading.value), name=f"t{i}")
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert values == [1024.0] * 4 and len(scaler.readers) == 1
    assert scaler.readers[0].startswith("t")  # on the thread that needed it


def test_each_step_reads_the_scale_it_starts_with():
    scaler = CountingScaler(8.0)
    scaler.scale(torch.ones(1))  # a backward's loss: the scaler's scale tensor made
    reading = ScaleReading()
    reading.start(scaler)
    assert reading.value == 8.0
    scaler.update(new_scale=2.0)  # changed by hand between steps: the next step sees it
    reading.start(scaler)
    assert reading.value == 2.0 and len(scaler.readers) == 2
    reading.start(None)
    assert reading.value is None and len(scaler.readers) == 2


def test_the_reading_feeds_the_chains_factors():
    follow, reading = LossScale(), ScaleReading()
    reading.start(CountingScaler(1024.0))
    follow.settle(reading.value, applied=True)
    reading.start(CountingScaler(2048.0))
    assert (follow.lr_factor(reading.value), follow.change(reading.value)) == (0.5, 2.0)
