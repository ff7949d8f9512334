"""Where and how the drafter runs, chosen in one place for the trainer (`train.prepare`), the offline
evaluation (`train.eval`) and the bench: device, autocast dtype, attention kernel and compilation.

    plan = choose_kernels(device="auto", precision="auto", attention="auto", compile=False,
                          head_dims=[drafter_cfg.head_dim], training=True, keys=TRAIN_KEYS)
    mask = plan.mask(anchors_BN, keep_BN, context_len, block_size, drafter_cfg.mask_rules)  # {layer type: flex
    BlockMask or dense mask}
    with plan.autocast(): ...

`attention = auto` takes flex only where its kernel works for the head size and the device, else
SDPA with the dense mask (same rule, same numbers). What flex needs, from torch's own checks:

- CUDA: the compiled Triton kernel (`torch._inductor.kernel.flex`), so Triton must be usable
  (`torch.utils._triton.has_triton`: the package and compute capability >= 7.0); Triton's `tl.dot`
  needs head_dim >= 16 ("NYI: embedding dimension ... must be at least 16"); non-power-of-two head
  dims are padded only from torch 2.6 on. auto also keeps to head_dim <= 256, the largest size
  torch's flex configs are tuned for (larger ones fall back to untuned tiles).
- CPU: flex has no backward (training), and its unfused form materializes every score, so auto
  never takes it there; an explicit `attention = flex` is still allowed for evaluation (no grad).

`compile = true` needs TorchDynamo on this Python and an Inductor backend for the device: Triton on
CUDA, a C++ compiler on the CPU. An explicit choice that cannot work raises `ValueError` naming the
config key and the reason, before anything is trained. The choice and its reason are logged once,
as one line, and saved with the run (run.json) or the evaluation report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Sequence

import torch

from common.device import autocast_dtype, resolve_device
from train.attention import build_block_mask, build_dense_mask, build_layer_masks

__all__ = [
    "KernelKeys",
    "KernelPlan",
    "OnKernels",
    "TRAIN_KEYS",
    "EVAL_KEYS",
    "choose_kernels",
    "flex_problem",
    "compile_problem",
    "FLEX_MIN_HEAD_DIM",
    "FLEX_TUNED_MAX_HEAD_DIM",
]

log = logging.getLogger(__name__)

FLEX_MIN_HEAD_DIM = 16  # Triton's tl.dot; torch/_inductor/kernel/flex/flex_attention.py refuses less on CUDA
FLEX_TUNED_MAX_HEAD_DIM = 256  # torch's flex configs (template_heuristics) are tuned up to this head dim


@dataclasses.dataclass(frozen=True)
class KernelKeys:
    """The config keys the choices come from, for error messages (None: the stage has no such key)."""

    attention: str
    compile: str | None


TRAIN_KEYS = KernelKeys(attention="model.attention", compile="compile")
EVAL_KEYS = KernelKeys(attention="attention", compile=None)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The resolved choices of one run."""

    device: torch.device
    autocast_dtype: torch.dtype | None  # None = plain fp32
    attention: str  # "flex" | "sdpa"
    compile: bool
    reason: str  # why this attention kernel (and compile setting)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def mask(
        self,
        anchors_BN: torch.Tensor,
        keep_BN: torch.Tensor,
        context_len: int,
        block_size: int,
        rules: dict | None = None,
    ):
        """The DFlash training mask in the form the chosen kernel takes (train.attention.attend runs either):
        {layer type: mask} for a drafter's `DrafterConfig.mask_rules`, or one full-attention mask without rules."""
        if rules is not None:
            return build_layer_masks(self.attention, anchors_BN, keep_BN, context_len, block_size, rules)
        build = build_block_mask if self.attention == "flex" else build_dense_mask
        return build(anchors_BN, keep_BN, context_len, block_size)

    @property
    def precision(self) -> str:
        return "bf16" if self.autocast_dtype == torch.bfloat16 else "fp32"

    def describe(self) -> str:
        """The one log line: `kernels: device cuda, bf16 autocast, attention sdpa (...), compile off`."""
        precision = "bf16 autocast" if self.autocast_dtype is not None else "fp32"
        return (
            f"kernels: device {self.device.type}, {precision}, attention {self.attention} ({self.reason}), "
            f"compile {'on' if self.compile else 'off'}"
        )

    def to_dict(self) -> dict:
        return {
            "device": self.device.type,
            "precision": self.precision,
            "attention": self.attention,
            "compile": self.compile,
            "reason": self.reason,
        }


class OnKernels:
    """Mixin for what runs on a plan (the trainer's Run, the evaluation's Runtime): its `kernels`'
    device and autocast dtype as attributes of its own."""

    @property
    def device(self) -> torch.device:
        return self.kernels.device

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.kernels.autocast_dtype


# ----------------------------------------------------------------------------------------------
# What the device can run


def _triton_usable() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # very old torch: no Triton helper, so no way to trust Triton
        return False
    try:
        return bool(has_triton())
    except Exception:  # noqa: BLE001 - a broken Triton install is "not usable", not a crash of the run
        return False


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def flex_problem(device: torch.device, head_dim: int, *, training: bool) -> str | None:
    """Why flex attention cannot run a drafter with this head dim on `device` (None: it can)."""
    if device.type == "cpu":
        return "flex_attention has no backward on CPU" if training else None
    if device.type != "cuda":
        return f"flex here runs on CPU and CUDA only, not {device.type}"
    if head_dim < FLEX_MIN_HEAD_DIM:
        return f"flex's CUDA kernel needs head_dim >= {FLEX_MIN_HEAD_DIM} (Triton tl.dot), the drafter has {head_dim}"
    if not _triton_usable():
        return (
            "flex on CUDA needs its compiled Triton kernel and Triton is not usable here "
            "(torch.utils._triton.has_triton() is False)"
        )
    if not _power_of_two(head_dim) and _torch_version() < (2, 6):
        return (
            f"flex in torch {torch.__version__} takes power-of-two head dims only (any from torch 2.6), the "
            f"drafter has {head_dim}"
        )
    return None


def compile_problem(device: torch.device) -> str | None:
    """Why torch.compile (Inductor) cannot compile the step on `device` (None: it can)."""
    try:
        import torch._dynamo as dynamo
    except ImportError as exc:
        return f"TorchDynamo cannot be imported ({exc})"
    if hasattr(dynamo, "is_dynamo_supported") and not dynamo.is_dynamo_supported():
        return f"TorchDynamo does not support this Python ({sys.version.split()[0]}) with torch {torch.__version__}"
    if device.type == "cuda":
        if not _triton_usable():
            return (
                "Inductor compiles CUDA code with Triton and Triton is not usable here "
                "(torch.utils._triton.has_triton() is False)"
            )
        return None
    if device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except ImportError:
            return None  # an older layout of Inductor: let torch.compile report it if it fails
        except Exception as exc:  # noqa: BLE001 - whatever the search raises means "no compiler"
            return f"Inductor's CPU backend finds no C++ compiler ({type(exc).__name__}: {exc})"
        return None
    return f"compilation is supported here on CPU and CUDA only, not {device.type}"


# ----------------------------------------------------------------------------------------------
# The choice


def _choose_attention(
    choice: str, device: torch.device, head_dims: Sequence[int], *, training: bool, key: str
) -> tuple[str, str]:
    """(kernel, reason) for an `attention` config value."""
    if choice == "sdpa":
        return "sdpa", f"{key}=sdpa"
    problems = [p for p in (flex_problem(device, e, training=training) for e in sorted(set(head_dims))) if p]
    if choice == "flex":
        if problems:
            raise ValueError(f"config key '{key}': flex cannot run here: {problems[0]}; use sdpa or auto")
        return "flex", f"{key}=flex"
    assert choice == "auto", choice
    if device.type != "cuda":
        return (
            "sdpa",
            f"auto: sdpa with a dense mask on {device.type} (flex is taken only on CUDA, as its compiled kernel)",
        )
    if problems:
        return "sdpa", f"auto: sdpa with a dense mask, not flex: {problems[0]}"
    large = [e for e in head_dims if e > FLEX_TUNED_MAX_HEAD_DIM]
    if large:
        return "sdpa", (
            f"auto: sdpa with a dense mask, not flex: head_dim {max(large)} > {FLEX_TUNED_MAX_HEAD_DIM}, "
            f"the largest torch's flex kernels are tuned for (set {key}=flex to try it)"
        )
    dims = ", ".join(str(e) for e in sorted(set(head_dims)))
    return "flex", f"auto: flex on CUDA for head_dim {dims}"


def choose_kernels(
    device: str,
    precision: str,
    attention: str,
    compile: bool,
    head_dims: Sequence[int],
    *,
    training: bool,
    keys: KernelKeys,
    rank_device: torch.device | None = None,
    announce: bool = True,
) -> KernelPlan:
    """Resolve the config's device/precision/attention/compile for drafters of these head dims.

    ValueError naming the key when an explicit choice cannot work here; logs the choice once.
    `rank_device`: under data parallelism, this process's own device (cuda:LOCAL_RANK, from
    `train.distributed`), of the type `device` resolves to: the plan runs there. `announce=False`
    keeps the log line to one process (the other ranks of a data-parallel run).
    """
    if not head_dims:
        raise ValueError("choose_kernels needs the drafter's head dim")
    resolved = resolve_device(device)
    if rank_device is not None:
        assert rank_device.type == resolved.type, (rank_device, resolved)
        resolved = rank_device
    kernel, reason = _choose_attention(attention, resolved, head_dims, training=training, key=keys.attention)
    if compile:
        problem = compile_problem(resolved)
        if problem:
            name = keys.compile or "compile"
            raise ValueError(f"config key '{name}': torch.compile cannot work here: {problem}; set {name}=false")
    plan = KernelPlan(resolved, autocast_dtype(precision, resolved), kernel, bool(compile), reason)
    if announce:
        log.info("%s", plan.describe())
    return plan
