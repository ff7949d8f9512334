"""The export format: a training checkpoint written as a Hugging Face DFlash drafter directory
(docs/dflash.md "Export format"), and such a directory read back (`load_exported`,
`drafter_config_from_export`, `check_weights`). The command is `python -m train.serve.export`.

`export_checkpoint(CHECKPOINT, OUT_DIR)`: CHECKPOINT is a checkpoint directory (`step-XXXXXXXX/`)
or a run directory (its latest checkpoint is used). OUT_DIR receives:

    config.json        the published DFlash format: architectures ["DFlashDraftModel"] (DFlash2:
                       ["DFlash2DraftModel"]), auto_map {"AutoModel": "dflash.<that class>"},
                       model_type "qwen3", top-level
                       block_size and num_target_layers, dflash_config {mask_token_id,
                       target_layer_ids, block_size, causal, layer_causal, use_swa,
                       swa_window_size; DFlash2: conv_kernel_size, conv_group_size, selector_rank,
                       selector_top_k; input_embedding_scale where the target's embedding module
                       scales its rows), layer_types, sliding_window, use_sliding_window,
                       is_causal (the attention semantics, `attention_semantics`), widths, rope
                       settings as trained (top-level rope_theta / rope_scaling /
                       partial_rotary_factor for older readers, rope_parameters with all three,
                       which transformers 5 and vLLM read, is_neox_style), vocab_size, dtype (and
                       torch_dtype, its transformers 4 name)
    model.safetensors  fc.weight, hidden_norm.weight, layers.N...., norm.weight (no `model.`
                       prefix, no embedding, no lm_head: those are the target's); DFlash2 adds
                       layers.N.{attention,mlp}_conv.{base_kernel, kernel_projection.weight} and
                       candidate_selector.{predecessor_codebook, successor_codebook,
                       hidden_projection.weight} (the codebooks bare, as published)
    dflash.py          the model code (a copy of train/export_format/dflash_hf.py), so that
                       AutoModel.from_pretrained(OUT_DIR, trust_remote_code=True) builds the drafter
    dflash_export.json where it came from (checkpoint, step, git sha) and the target it is for
                       (`target_identity`, `target_check`: target.identity_check; speculative
                       decoding compares its target with it; `input_embedding_scale`: the target's
                       embedding scale, null where no target was found), not read by any loader

`model_type` is "qwen3" as in the published checkpoints: transformers builds a `Qwen3Config` from
the file (keeping the extra DFlash keys), and with trust_remote_code the `auto_map` entry wins over
the built-in Qwen3Model. The published DFlash2 configs carry no `auto_map` (engines and z-lab's
`dflash` package pick the class by `architectures`); ours keep it for a DFlash2 export too, which
those readers ignore, so that AutoModel with trust_remote_code builds it as it builds a DFlash one.
The directory is written under a temporary name and renamed into place.

A drafter trained on projected features (a storage tier, shards/FORMAT.md) is exported with the
projection folded into fc (fc = fc'·P, P from its training dataset or `--projection FILE`), so the
export reads full features like any other.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from types import SimpleNamespace

import torch

from common.io import read_record, replace_local_dir
from common.provenance import git_sha, tool_version
from target.arch import check_architecture
from target.checkpoint import text_config
from target.identity import target_identity
from target.identity_check import OVERRIDE_KEY, check_target, recorded_identity
from target.load import DTYPES
from train.checkpoint import DRAFTER_CONFIG_FILE, MODEL_FILE, STATE_FILE, latest_checkpoint, verify_checkpoint
from train.dflash2 import build_drafter
from train.drafter_config import DFLASH2_FIELDS, DrafterConfig, rope_settings
from train.export_format.dflash_hf import DFlash2DraftModel, DFlashDraftModel, layer_attention
from train.layer_types import FULL_ATTENTION, SLIDING_ATTENTION
from train.stored_features import fold_projection, projection_for_drafter

__all__ = [
    "export_config",
    "drafter_config_from_export",
    "expected_weight_names",
    "export_drafter",
    "export_checkpoint",
    "load_exported",
    "resolve_checkpoint",
]

MODEL_CODE = Path(__file__).with_name("dflash_hf.py")
CODE_FILE = "dflash.py"
CONFIG_FILE = "config.json"
INFO_FILE = "dflash_export.json"
ARCHITECTURE = "DFlashDraftModel"
# The published class name of each drafter class (`DrafterConfig.arch`), and the exported model code's class.
ARCHITECTURES = {"dflash": ARCHITECTURE, "dflash2": "DFlash2DraftModel"}
MODEL_CLASSES = {"DFlashDraftModel": DFlashDraftModel, "DFlash2DraftModel": DFlash2DraftModel}


def attention_semantics(cfg: DrafterConfig) -> dict:
    """The causality keys serving engines read (docs/serving.md), for the drafter's layers.

    vLLM (`qwen3_dflash._dflash_layer_causal`) and z-lab's model code take a top-level `is_causal`
    for every layer, vLLM then `dflash_config.causal`, and otherwise run sliding_attention layers
    causally and full_attention layers bidirectionally; SGLang always does the latter. So: one
    causality for all layers is written as `is_causal` and `dflash_config.causal`; a mix (the
    default: causal sliding layers, bidirectional full ones) is exactly the engines' default and
    is written as null, never overriding it. `dflash_config.layer_causal` states the per-layer
    result explicitly (read back and checked by `drafter_config_from_export`; engines ignore it).
    """
    causal = cfg.layer_causal
    uniform = causal[0] if len(set(causal)) == 1 else None
    extra = {"causal": uniform, "layer_causal": causal, "use_swa": False}
    if cfg.sliding_window is not None:
        extra["swa_window_size"] = cfg.sliding_window  # vLLM reads it before sliding_window
    return {"is_causal": uniform, "dflash_config": extra}


def serving_warnings(cfg: DrafterConfig) -> list[str]:
    """What a serving engine would run differently from training (empty when all engines agree)."""
    if SLIDING_ATTENTION in cfg.layer_types and cfg.sliding_in_block == "bidirectional":
        return [
            "sliding_attention layers trained bidirectional inside the block: SGLang runs them causally whatever "
            "is_causal says, and vLLM's non-causal sliding window is not verified; serve with z-lab's model code or "
            "this export's dflash.py (docs/serving.md)"
        ]
    return []


def target_embed_scale(target_dir: str | None) -> float | None:
    """What the target's input embedding module multiplies a table row by (Gemma: sqrt(hidden)), which the
    drafter's block embedding includes; None where the target is not found or not checkable."""
    if not target_dir or not Path(target_dir, "config.json").is_file():
        return None
    try:
        return check_architecture(target_dir).embed_scale
    except ValueError:
        return None


def target_warnings(target_dir: str | None) -> list[str]:
    """What a serving engine would feed a drafter of this target differently from training (docs/serving.md,
    "Embedding and head")."""
    if not target_dir or not Path(target_dir, "config.json").is_file():
        return [
            "no target directory: dflash_config.input_embedding_scale is not written (read as 1); for a target "
            "whose embedding module scales its rows (Gemma), export again with target=DIR"
        ]
    try:
        scale = check_architecture(target_dir).embed_scale
    except ValueError as exc:  # the export is written; say why its target was not checked
        return [f"the target's architecture was not checked: {exc}"]
    if scale == 1.0:
        return []
    return [
        f"the target's input embedding multiplies each row by {scale:.6g}, and the drafter was trained on that: "
        "the export writes dflash_config.input_embedding_scale, which vLLM's DFlash2 model and z-lab's newer loop "
        "apply to the raw table; SGLang does not read it and embeds the block with the target's module "
        "(docs/serving.md)"
    ]


def export_config(
    cfg: DrafterConfig, *, dtype: str = "bfloat16", token_ids: dict | None = None, embed_scale: float | None = None
) -> dict:
    """The published config.json of a drafter (docs/dflash.md "Export format"), as a dict; `embed_scale`: what
    the target's embedding module multiplies a row by, written as `dflash_config.input_embedding_scale`
    where it is not 1 (absent reads as 1 everywhere, so a DFlash export of any other target is unchanged)."""
    if dtype not in DTYPES:
        raise ValueError(f"export dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if cfg.projection is not None:  # a DFlash runtime feeds full tap features: fc must read them
        raise ValueError(
            f"the drafter reads projected features (projection {cfg.projection.get('checksum')}): "
            "fold the projection into fc first (train.stored_features.fold_projection; train.serve.export does)"
        )
    # Rope as trained, every part spelled out: vLLM reads rope_parameters (partial factor included),
    # older readers the top-level keys; the half-split (neox) rotation is what both engines default to.
    rope_parameters = {
        "rope_type": "default",
        **(cfg.rope_scaling or {}),
        "rope_theta": float(cfg.rope_theta),
        "partial_rotary_factor": float(cfg.partial_rotary_factor),
    }
    n = cfg.num_hidden_layers
    architecture = ARCHITECTURES[cfg.arch]
    dflash_config = {
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "block_size": cfg.block_size,
        **attention_semantics(cfg)["dflash_config"],
    }
    if cfg.arch == "dflash2":
        dflash_config.update({name: getattr(cfg, name) for name in DFLASH2_FIELDS})
    if embed_scale is not None and embed_scale != 1.0:
        dflash_config["input_embedding_scale"] = float(embed_scale)
    config = {
        "architectures": [architecture],
        "auto_map": {"AutoModel": f"{Path(CODE_FILE).stem}.{architecture}"},
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": dflash_config,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "partial_rotary_factor": float(cfg.partial_rotary_factor),
        "rope_parameters": rope_parameters,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "layer_types": list(cfg.layer_types),
        "max_window_layers": n,  # inert: transformers derives layer_types from it only when layer_types is absent
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": cfg.sliding_window
        is not None,  # transformers' Qwen3Config drops sliding_window without it
        "is_causal": attention_semantics(cfg)["is_causal"],
        "is_neox_style": True,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.initializer_range,
        "dtype": dtype,
        "torch_dtype": dtype,  # the transformers 4 spelling, for serving stacks that still read it
        "use_cache": True,
    }
    if cfg.target_hidden_size is not None and cfg.target_hidden_size != cfg.hidden_size:
        config["target_hidden_size"] = cfg.target_hidden_size
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = (token_ids or {}).get(key)
    return config


def drafter_config_from_export(config: dict) -> DrafterConfig:
    """The DrafterConfig an exported config.json describes (inverse of `export_config`).

    Reads the DFlash keys from `dflash_config` or the top level, and the rope settings in either
    spelling (transformers 5 `rope_parameters` or top-level rope_theta / rope_scaling).
    """
    nested = config.get("dflash_config") or {}

    def dflash(name: str):
        value = nested.get(name, config.get(name))
        if value is None:
            raise ValueError(f"exported config has no '{name}' (neither in dflash_config nor at the top level)")
        return value

    theta, scaling, factor = rope_settings(config)
    n = int(config["num_hidden_layers"])
    layer_types, window, sliding_in_block = _attention_from_export(config, nested, n)
    return DrafterConfig(
        **_drafter_class_from_export(config, nested),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=int(config["num_key_value_heads"]),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"])),
        vocab_size=int(config["vocab_size"]),
        target_layer_ids=[int(i) for i in dflash("target_layer_ids")],
        num_target_layers=int(dflash("num_target_layers")),
        mask_token_id=int(dflash("mask_token_id")),
        block_size=int(dflash("block_size")),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=factor,
        max_position_embeddings=int(config.get("max_position_embeddings", 40960)),
        attention_bias=bool(config.get("attention_bias", False)),
        hidden_act=str(config.get("hidden_act", "silu")),
        initializer_range=float(config.get("initializer_range", 0.02)),
        target_hidden_size=config.get("target_hidden_size"),
        layer_types=layer_types,
        sliding_window=window,
        sliding_in_block=sliding_in_block,
    )


def _drafter_class_from_export(config: dict, nested: dict) -> dict:
    """{arch, and DFlash2's fields} of an exported config (its `architectures`); ValueError for a class or a
    logit transform (`output_multiplier`, `final_logit_softcapping`) this project's model does not compute."""
    names = list(config.get("architectures") or [ARCHITECTURE])
    arch = next((a for a, name in ARCHITECTURES.items() if name in names), None)
    if arch is None:
        raise ValueError(f"exported config: architectures {names} names neither of {sorted(MODEL_CLASSES)}")
    for key, neutral in (("output_multiplier", 1.0), ("final_logit_softcapping", None)):
        if nested.get(key, neutral) not in (neutral, 0, 0.0):
            raise ValueError(f"exported config: dflash_config.{key} = {nested[key]}; this project's drafter has none")
    if arch == "dflash":
        return {}
    missing = [name for name in DFLASH2_FIELDS if nested.get(name) is None]
    if missing:
        raise ValueError(f"exported config: a DFlash2DraftModel needs dflash_config.{missing[0]}")
    return {"arch": arch, **{name: int(nested[name]) for name in DFLASH2_FIELDS}}


def _attention_from_export(config: dict, nested: dict, n: int) -> tuple[list[str], int | None, str]:
    """(layer_types, sliding_window, sliding_in_block) as the export's dflash.py (and vLLM) read
    config.json; ValueError for a layout this project's model does not compute (e.g. causal
    full_attention layers) or a `dflash_config.layer_causal` that contradicts the rest."""
    layer_types = list(config.get("layer_types") or [FULL_ATTENTION] * n)
    per_layer = layer_attention(SimpleNamespace(**{**config, "num_hidden_layers": n, "dflash_config": nested}))
    window = next((w for w, _ in per_layer if w is not None), None)
    causal = [c for _, c in per_layer]
    full_causal = [i for i, t in enumerate(layer_types) if t == FULL_ATTENTION and causal[i]]
    if full_causal:
        raise ValueError(
            f"exported config: full_attention layers {full_causal} are causal (is_causal / dflash_config.causal); "
            "this project's drafter runs full_attention layers bidirectionally"
        )
    sliding = {causal[i] for i, t in enumerate(layer_types) if t == SLIDING_ATTENTION}
    sliding_in_block = "bidirectional" if sliding == {False} else "causal"
    stated = nested.get("layer_causal")
    if stated is not None and [bool(c) for c in stated] != causal:
        raise ValueError(
            f"exported config: dflash_config.layer_causal {stated} disagrees with what the engines read "
            f"from is_causal / dflash_config.causal / layer_types ({causal})"
        )
    return layer_types, window, sliding_in_block


def expected_weight_names(cfg: DrafterConfig) -> set[str]:
    """Every tensor name a drafter of this shape stores (the published names)."""
    with torch.device("meta"):
        return set(build_drafter(cfg).state_dict())


def check_weights(state: dict[str, torch.Tensor], cfg: DrafterConfig, source: str) -> None:
    """ValueError naming the tensors when `state` is not exactly a drafter of shape `cfg`."""
    expected = expected_weight_names(cfg)
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ValueError(
            f"'{source}': weights do not match the drafter config: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in build_drafter(cfg).state_dict().items()}
    wrong = [
        f"{k} {tuple(state[k].shape)} != {shapes[k]}" for k in sorted(expected) if tuple(state[k].shape) != shapes[k]
    ]
    if wrong:
        raise ValueError(f"'{source}': tensor shapes do not match the drafter config: {wrong[:5]}")


def _prepare_out_dir(out: Path) -> None:
    """Refuse to replace a non-empty directory that is not an earlier export."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"export OUT_DIR '{out}' exists and is not a directory")
    if any(out.iterdir()):
        try:
            earlier = json.loads((out / CONFIG_FILE).read_text()).get("architectures") in [[n] for n in MODEL_CLASSES]
        except (OSError, ValueError):
            earlier = False
        if not earlier:
            raise ValueError(
                f"export OUT_DIR '{out}' is a non-empty directory that is not a DFlash export; refusing to replace it"
            )


def export_drafter(
    state: dict[str, torch.Tensor],
    cfg: DrafterConfig,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    token_ids: dict | None = None,
    info: dict | None = None,
    embed_scale: float | None = None,
) -> Path:
    """Write the export directory for drafter weights `state` of shape `cfg`; returns its path.
    `embed_scale`: the target's embedding scale (`export_config`)."""
    from safetensors.torch import save_file

    check_weights(state, cfg, "drafter state")
    config = export_config(cfg, dtype=dtype, token_ids=token_ids, embed_scale=embed_scale)
    out = Path(out_dir).resolve()
    _prepare_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir()
    try:
        tensors = {name: state[name].detach().to("cpu", DTYPES[dtype]).contiguous() for name in sorted(state)}
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        shutil.copyfile(MODEL_CODE, tmp / CODE_FILE)
        (tmp / INFO_FILE).write_text(json.dumps(info or {}, indent=2, sort_keys=True) + "\n")
        _make_readable(tmp)
        replace_local_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _make_readable(directory: Path) -> None:
    """Files as a plain `open()` would create them (safetensors writes 0600): a serving process of
    another user must be able to read the export."""
    umask = os.umask(0)
    os.umask(umask)
    for file in directory.iterdir():
        os.chmod(file, 0o666 & ~umask)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory from a checkpoint or run directory (ValueError naming the path)."""
    path = Path(path)
    if (path / DRAFTER_CONFIG_FILE).is_file() and (path / MODEL_FILE).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise ValueError(
        f"'{path}' is neither a checkpoint directory ({MODEL_FILE} + {DRAFTER_CONFIG_FILE}) nor a run directory "
        "with checkpoints"
    )


def _run_info(checkpoint: Path) -> dict:
    """The run's run.json (runs/NAME/checkpoints/step-X -> runs/NAME/run.json); {} when absent."""
    return read_record(checkpoint.parent.parent / "run.json")


def export_target_check(checkpoint: Path, target: str | None, allowed: bool) -> tuple[dict, dict]:
    """(the identity the export records, the check record): the target's, checked against the
    identity the run recorded (target.identity); without a target directory, the run's as recorded."""
    recorded = _run_info(checkpoint).get("target_identity")
    if not target or not Path(target, "config.json").is_file():
        note = {"status": "unchecked", "target": target, "reason": "no target directory given or found"}
        return recorded_identity(recorded), note
    identity = target_identity(target)
    made = f"run '{checkpoint.parent.parent}' trained with"
    return identity, check_target(identity, recorded, made=made, key=OVERRIDE_KEY, allowed=allowed)


def target_token_ids(target_dir: str, cfg: DrafterConfig) -> dict:
    """bos/eos/pad ids from the target's config; ValueError if the target cannot host this drafter."""
    target = text_config(target_dir)
    if int(target["vocab_size"]) != cfg.vocab_size:
        raise ValueError(f"target '{target_dir}' has vocab_size {target['vocab_size']}, the drafter {cfg.vocab_size}")
    hidden = cfg.target_hidden_size or cfg.hidden_size
    if int(target["hidden_size"]) != hidden:
        raise ValueError(
            f"target '{target_dir}' has hidden_size {target['hidden_size']}, the drafter's fc expects {hidden}"
        )
    return {key: target.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    target: str | None = None,
    projection: str | None = None,
    allow_target_mismatch: bool = False,
) -> Path:
    """Export a training checkpoint (or a run's latest one). Token ids come from `target` or the run's target.

    A drafter trained on projected features (a storage tier) is exported with P folded into fc
    (fc = fc'·P, in float32), so it reads full tap features like any DFlash drafter; P comes from
    the run's training dataset, or from the file `projection`. A target other than the run's is
    refused unless `allow_target_mismatch` (target.identity); dflash_export.json records it."""
    from safetensors.torch import load_file

    ckpt = resolve_checkpoint(checkpoint)
    step, train_config = None, {}
    if (ckpt / STATE_FILE).is_file():
        saved = verify_checkpoint(ckpt, files=(MODEL_FILE, DRAFTER_CONFIG_FILE))  # names a damaged file
        step, train_config = saved.get("step"), saved.get("config") or {}
    try:
        cfg = DrafterConfig.from_dict(json.loads((ckpt / DRAFTER_CONFIG_FILE).read_text()))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"'{ckpt / DRAFTER_CONFIG_FILE}': {exc}") from None
    state = load_file(str(ckpt / MODEL_FILE))
    check_weights(state, cfg, str(ckpt / MODEL_FILE))
    folded = None
    if cfg.projection is not None:
        folded = cfg.projection["checksum"]
        p = projection_for_drafter(cfg, (train_config.get("data") or {}).get("shards"), projection)
        state, cfg = fold_projection(state, cfg, p)
    target = target or _run_info(ckpt).get("target")
    identity, check = export_target_check(ckpt, target, allow_target_mismatch)
    token_ids = target_token_ids(target, cfg) if target and Path(target, "config.json").is_file() else None
    embed_scale = target_embed_scale(target)
    info = {
        "checkpoint": str(ckpt.resolve()),
        "step": step,
        "target": target,
        "target_identity": identity,
        "target_check": check,
        "dtype": dtype,
        "git_sha": git_sha(),
        "tool_version": tool_version(),
        "folded_projection": folded,
        "input_embedding_scale": embed_scale,
    }
    return export_drafter(state, cfg, out_dir, dtype=dtype, token_ids=token_ids, info=info, embed_scale=embed_scale)


def load_exported(
    export_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = torch.float32,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
):
    """An exported drafter (`DFlashDraftModel` or `DFlash2DraftModel`, as config.json's `architectures`
    says), in eval mode.

    By default it is built by this project's own model code (`train/export_format/dflash_hf.py`, the file every
    export ships as dflash.py): nothing from the directory but config.json and the weights is used,
    so a drafter directory from elsewhere runs no code. `trust_remote_code=True` goes through
    transformers' remote-code path instead (what serving code does: the directory's dflash.py runs).
    """
    try:
        names = json.loads(Path(export_dir, CONFIG_FILE).read_text()).get("architectures") or [ARCHITECTURE]
    except (OSError, ValueError) as exc:
        raise ValueError(f"'{Path(export_dir, CONFIG_FILE)}' cannot be read: {exc}") from None
    wanted = next((name for name in names if name in MODEL_CLASSES), None)
    if wanted is None:
        raise ValueError(f"'{export_dir}': architectures {names} names neither of {sorted(MODEL_CLASSES)}")
    if trust_remote_code:
        from transformers import AutoModel

        model = AutoModel.from_pretrained(str(export_dir), trust_remote_code=trust_remote_code, dtype=dtype)
    else:
        model = MODEL_CLASSES[wanted].from_pretrained(str(export_dir), dtype=dtype)
    if type(model).__name__ != wanted:
        raise ValueError(f"'{export_dir}' loaded as {type(model).__name__}, not {wanted} (is auto_map missing?)")
    return model.to(device).eval().requires_grad_(False)
