"""Helpers shared by the Reactor test files (tests/test_reactor_*.py): frame shapes, the float64 default of their
textbook comparisons, and a batch of random sequences for the network and the loss."""

import pytest
import torch

import reactor

ATARI = (1, 84, 84)  # an Atari frame's shape
MINATAR = (4, 10, 10)  # a MinAtar frame's shape


@pytest.fixture(autouse=True)
def float64_by_default():
    """Textbook comparisons run in float64; the default is restored so other test files keep float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def float32(float64_by_default):
    torch.set_default_dtype(torch.float32)
    yield


def make_batch(B, T, A, H, rng, pad_at=None):
    term = torch.zeros(B, T + 1, dtype=torch.bool)
    pad = torch.zeros_like(term)
    first = torch.zeros_like(term)
    term[0, 3] = True
    first[0, 4] = True
    if pad_at is not None:
        pad[1, pad_at] = True
        first[1, pad_at + 1] = True
    mu = torch.softmax(torch.tensor(rng.normal(size=(B, T + 1, A)), dtype=torch.float32), -1)
    return reactor.Batch(
        torch.randint(0, 255, (B, T + 1, 84, 84), dtype=torch.uint8),
        torch.tensor(rng.integers(0, A, (B, T + 1))),
        torch.randn(B, T + 1, dtype=torch.float32),
        term,
        pad,
        first,
        mu,
        tuple(torch.zeros(B, H, dtype=torch.float32) for _ in range(4)),
        torch.ones(B, dtype=torch.float32),
    )
