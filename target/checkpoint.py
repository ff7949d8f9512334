"""Read a Hugging Face target checkpoint directory without building the model.

The trainer needs only the target's text-decoder config (widths, rope settings, vocabulary) and two
frozen tensors (the embedding and `lm_head`); loading a 27B model for that would waste a minute and
50 GiB. `load_tensors` opens the safetensors files lazily and reads just the requested tensors.

Names are asked for in the plain causal-LM spelling (`model.embed_tokens.weight`,
`lm_head.weight`, `model.norm.weight`); multimodal checkpoints such as Qwen3.6 store the decoder
under `model.language_model.` and are found too. `lm_head.weight` falls back to the embedding
when the config ties the two (or when the checkpoint has no head and does not say it is untied).
Where a family stores them under other names (GPT-2's `transformer.wte`, GPT-NeoX's `embed_in`),
`target.arch.check_architecture` finds the stored names through the model's own accessors.

`text_config` also carries the canonical spellings transformers' config class gives a checkpoint
(`hidden_size` for GPT-2's `n_embd`, by the class's attribute map; `rope_parameters` built from
older rope keys), so readers of widths, heads and rope need to know one spelling only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import CONFIG_MAPPING, PretrainedConfig

from target.rules import nested_text_config

__all__ = [
    "read_config",
    "text_config",
    "load_tensors",
    "tensor_names",
    "stored_name",
    "EMBED",
    "LM_HEAD",
    "INDEX_FILE",
    "weight_files",
    "check_weight_files",
]

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
_SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(target_dir: str | os.PathLike) -> dict:
    """The checkpoint's `config.json` as a dict, read as transformers reads it (ValueError if missing
    or not JSON): `PretrainedConfig.get_config_dict`, which turns the `{"__float__": "Infinity"}`
    objects transformers writes for non-finite floats (Mamba-2's `time_step_limit`) back into floats."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"target directory '{target_dir}' has no config.json")
    try:
        config, _ = PretrainedConfig.get_config_dict(str(Path(target_dir)))
    except (json.JSONDecodeError, OSError) as exc:
        raise ValueError(f"'{path}' is not valid JSON: {_first_line(exc)}") from None
    return config


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def text_config(target_dir: str | os.PathLike) -> dict:
    """The text decoder's config: the nested table of a multimodal or wrapper checkpoint (`text_config`,
    `llm_config`, `language_config`: `target.rules.nested_text_config`), else the top level.

    Keys the nested table lacks but the top level has (`tie_word_embeddings`, token ids) are
    carried over, because multimodal configs keep some of them only at the top.
    """
    top = read_config(target_dir)
    nested = nested_text_config(top)
    if nested is None:
        return with_canonical_keys(dict(top))
    merged = dict(nested)
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        if key not in merged and key in top:
            merged[key] = top[key]
    merged.setdefault("architectures", top.get("architectures"))
    return with_canonical_keys(merged)


def with_canonical_keys(config: dict) -> dict:
    """The config dict plus the spellings its transformers config class derives: the attribute map's
    canonical names (`hidden_size`, `num_attention_heads`, ... for GPT-2's `n_embd`, `n_head`) and
    `rope_parameters` (built from older keys such as GPT-NeoX's `rotary_emb_base`). A model type
    transformers does not know is returned as it is."""
    kind = config.get("model_type")
    if kind not in CONFIG_MAPPING:
        return config
    try:
        parsed = CONFIG_MAPPING[kind].from_dict(config)
    except (ValueError, TypeError, KeyError):  # a config its class refuses: the stages that build it say why
        return config
    out = dict(config)
    for key in getattr(parsed, "attribute_map", {}):
        if out.get(key) is None:
            out[key] = getattr(parsed, key, None)
    if out.get("rope_parameters") is None and isinstance(getattr(parsed, "rope_parameters", None), dict):
        out["rope_parameters"] = dict(parsed.rope_parameters)
    return out


def tensor_names(target_dir: str | os.PathLike) -> dict[str, str]:
    """Every stored tensor name mapped to the file (relative to the directory) that holds it."""
    root = Path(target_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"'{index}' has no weight_map")
        return dict(weight_map)
    files = [root / _SINGLE_FILE] if (root / _SINGLE_FILE).is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"target directory '{target_dir}' holds no safetensors weights ({_SINGLE_FILE} or {INDEX_FILE})"
        )
    names: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                names[name] = file.name
    return names


def weight_files(target_dir: str | os.PathLike) -> list[str]:
    """The safetensors files the checkpoint's weights are in (the index's, else every one there), by name."""
    root = Path(target_dir)
    index = root / INDEX_FILE
    if index.is_file():
        return sorted(set(tensor_names(root).values()))
    return sorted(p.name for p in root.glob("*.safetensors"))


def check_weight_files(target_dir: str | os.PathLike) -> None:
    """ValueError (one line naming the file) when a safetensors weight file is missing, truncated or
    damaged: its header does not parse, or describes more tensor bytes than the file holds. Reads the
    headers only (a truncated file otherwise ends the loader in a traceback)."""
    root = Path(target_dir)
    for name in weight_files(root):
        path = root / name
        if not path.is_file():
            raise ValueError(f"target '{target_dir}': {name}, named by {INDEX_FILE}, is missing")
        problem = _safetensors_problem(path)
        if problem:
            raise ValueError(f"target '{target_dir}': {name} is damaged or truncated ({problem}); copy it again")


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, less than a header"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return f"its header says {length} bytes of header, the file holds {size}"
        try:
            header = json.loads(f.read(length))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "its header is not a safetensors header"
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"its header describes {expected} bytes, the file holds {size}"
    return None


def _candidates(name: str) -> list[str]:
    """Spellings of a causal-LM tensor name in plain and multimodal checkpoints, most common first."""
    if name.startswith("model."):
        rest = name[len("model.") :]
        return [name, f"model.language_model.{rest}", f"language_model.model.{rest}", f"model.text_model.{rest}"]
    if name.startswith("lm_head."):
        return [name, f"language_model.{name}", f"model.language_model.{name}"]
    return [name]


def stored_name(name: str, stored: dict[str, str]) -> str | None:
    """How the checkpoint spells the causal-LM tensor `name` (plain or multimodal), None if absent."""
    return next((c for c in _candidates(name) if c in stored), None)


def _is_tied(config: dict) -> bool:
    # transformers' PretrainedConfig default is True when the key is absent.
    return bool(config.get("tie_word_embeddings", True))


def load_tensors(target_dir: str | os.PathLike, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read only the named tensors (in their stored dtype) from the directory's safetensors files.

    Returns a dict keyed by the names as asked. `lm_head.weight` of a tied model is the embedding.
    ValueError names the tensor when it cannot be found, and the head when untied but missing.
    """
    root = Path(target_dir)
    stored = tensor_names(root)
    wanted = list(dict.fromkeys(names))
    where: dict[str, str] = {}
    for name in wanted:
        found = stored_name(name, stored)
        if found is None and name.startswith("lm_head."):
            config = text_config(root)
            if not _is_tied(config):
                raise ValueError(
                    f"target '{target_dir}': '{name}' is not stored and the config says tie_word_embeddings=false"
                )
            found = stored_name(EMBED, stored)
        if found is None:
            sample = ", ".join(sorted(stored)[:5])
            raise ValueError(
                f"target '{target_dir}': no tensor '{name}' (looked for {_candidates(name)}; stored names start: "
                f"{sample}, ...)"
            )
        where[name] = found

    # Read each stored tensor once: a tied head is then the very same tensor as the embedding.
    read: dict[str, torch.Tensor] = {}
    by_file: dict[str, set[str]] = {}
    for spelled in where.values():
        by_file.setdefault(stored[spelled], set()).add(spelled)
    for file, spelled_names in by_file.items():
        with safe_open(str(root / file), framework="pt") as handle:
            for spelled in sorted(spelled_names):
                read[spelled] = handle.get_tensor(spelled)
    return {name: read[where[name]] for name in wanted}
