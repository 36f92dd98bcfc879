"""Shared fixtures: tiny checkpoints built once per session, and the real default model.

Tests marked `gpu` are skipped without CUDA. Tests marked `slow` always run (CI runs them);
deselect them locally with `-m "not slow"`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from runtime.config import DEFAULT_MODEL
from runtime.loader import resolve_model
from tests.fixtures import make_tiny_checkpoint, make_tiny_tokenizer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def signal_handlers_kept() -> Iterator[None]:
    """The CLI, run in-process, leaves Ctrl-C ignored after an interrupt (as a process about to
    exit should); each test gets the handlers it started with back."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in handlers.items():
        signal.signal(s, handler)


@pytest.fixture(scope="module")
def one_thread_module() -> Iterator[None]:
    """One torch thread for a test module: toy models on a busy 2-core machine run faster
    without a second one; the previous count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama checkpoint (hidden 64, 4 heads, 2 KV heads, vocab 256), float32."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir: Path) -> Any:
    """transformers' model of tiny_model_dir, float32, in eval mode (tests must not train it)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_random_drafter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer EAGLE-1 drafter with random weights for tiny_model_dir."""
    from tests.drafter_fixtures import make_random_drafter  # noqa: PLC0415

    return make_random_drafter(tiny_model_dir, tmp_path_factory.mktemp("tiny-drafter"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE (vocab 256; <unk>=0, <s>=1, </s>=2, <pad>=3) with a chat template."""
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct checkpoint (downloads and converts on first use)."""
    return resolve_model(DEFAULT_MODEL)
