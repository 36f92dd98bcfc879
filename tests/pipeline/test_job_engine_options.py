"""Jobs whose engine cannot be built (a KV cache budget that holds nothing, an attention
backend this machine lacks, a model that is missing or disagrees with its weights) are refused
naming the option or tensor, and leave no output directory behind."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pipeline.config import JobError
from pipeline.job import run_job
from pipeline.job_engine import build_engine
from runtime.config import EngineConfig
from runtime.engine import Engine
from tests.pipeline.bad_input_cases import _config
from tests.pipeline.helpers import write_parquet


def test_a_kv_cache_budget_that_holds_nothing_names_the_option(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory=1024)
    with pytest.raises(JobError, match="^--kv-cache-memory 1024: KV cache budget of 1024 bytes "
                                       "holds 0 blocks of "):
        build_engine(Engine, config)


def test_an_attention_backend_this_machine_lacks_names_the_option(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", attention_backend="flash")
    with pytest.raises(JobError, match=re.escape(
            "--attention-backend flash needs CUDA and the flash-attn package (pip install -e "
            ".[gpu])")):
        build_engine(Engine, config)


def test_a_job_refused_at_its_model_leaves_no_output_dir(tmp_path: Path) -> None:
    write_parquet(tmp_path / "in" / "x.parquet", {"id": ["a"], "prompt": ["hi"]})
    missing = tmp_path / "no-model"
    config = _config(tmp_path, missing)
    with pytest.raises(JobError, match=f"^cannot load --model {missing}: "):
        run_job(config, progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "out").mkdir()  # a directory that was there stays
    with pytest.raises(JobError, match=f"^cannot load --model {missing}: "):
        run_job(config, progress=False)
    assert os.listdir(tmp_path / "out") == [".eaglebatch.lock"]


def test_a_config_that_disagrees_with_its_weights_names_the_tensor(tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights have 128
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(JobError, match=re.escape(
            f"cannot load --model {model}: checkpoint does not match its config.json: "
            "model.layers.0.mlp.down_proj.weight has shape (64, 128), the config gives (64, 96)")):
        build_engine(Engine, EngineConfig(model=str(model), kv_cache_memory=1 << 20))


def test_a_kv_cache_budget_of_zero_is_named_as_given(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_memory=0)
    with pytest.raises(JobError, match="^--kv-cache-memory 0: KV cache budget of 0 bytes "):
        build_engine(Engine, config)
