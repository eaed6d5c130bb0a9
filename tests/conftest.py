"""Shared test setup. TRITON_INTERPRET must be set before triton is imported anywhere."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield
