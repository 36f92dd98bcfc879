"""What test modules of tests/runtime share: transformers' greedy reference of the engine tests
(per module), and two state dicts compared tensor by tensor (the loader and GGUF tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.runtime.engine_cases import Reference


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Reference:
    return Reference(tiny_model_dir)


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
