from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import EngineConfig
from runtime.engine import Engine


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Engine:
    """The real engine on the tiny checkpoint (max_model_len 512), shared by job tests that
    finish their generate() calls (an interrupted one would leave requests in its scheduler)."""
    return Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=16 << 20))
