import os

import pytest
import torch

# Keep CPU tests reproducible and within the 2-core CI machine: one thread per pytest-xdist worker (the
# README's command runs one worker per core), two without workers.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def random_qkv(batch=2, heads=6, kv_heads=2, n=257, d=32, dtype=torch.float64, seed=0, peaked=1.0,
               device="cpu"):
    """Random decode inputs; ``peaked`` scales q to make attention sharper than uniform."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, d, generator=g, dtype=torch.float64) * peaked
    k = torch.randn(batch, kv_heads, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, n, d, generator=g, dtype=torch.float64)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


@pytest.fixture(scope="session")
def default_model():
    """The offline SmolLM2-135M-Instruct and its tokenizer (loaded once per test session)."""
    import kvsieve

    return kvsieve.load_model("default")
