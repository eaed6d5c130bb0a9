"""Shared test setup. TRITON_INTERPRET must be set before triton is imported anywhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


@pytest.fixture(scope="module")
def megatron_world():
    """A one-process gloo world with megatron parallel state (CPU shims installed) for a test module."""
    from quads_megatron.demo.cpu_megatron import init_distributed, install_cpu_shims_for_megatron

    install_cpu_shims_for_megatron()
    init_distributed()
    yield


@pytest.fixture
def clean_quads_patches():
    """No QUADS patches or stats before and after the test."""
    import quads_megatron
    from quads_megatron import fake_quant

    quads_megatron.remove()
    fake_quant.reset_stats()
    yield
    quads_megatron.remove()
