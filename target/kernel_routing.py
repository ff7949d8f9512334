"""External kernels (fla, causal-conv1d) only for the tensors they take, on the modules a loaded
target's layers come from. `target.load.reach_text_parts` applies both routings to every target
it loads; `target.packing` reads what they bound to decide whether a target can be packed.

The delta rule: transformers binds functions such as the Gated DeltaNet's `chunk_gated_delta_rule`
to the `fla` Triton kernels when `fla` is importable, whatever device the model later runs on; a CPU
model on a host with `fla` installed then fails inside Triton. `route_kernels_by_device` sends CPU
and float64 tensors to transformers' own torch implementation and keeps the fast kernels for CUDA
tensors.

The convolution: transformers' `causal_conv1d_fn` falls back to its reference PyTorch code when the
`causal-conv1d` package is missing (no wheel for these hosts), although fla, which the Gated DeltaNet
already uses, has a Triton one that takes `cu_seqlens`. `install_fla_convolution` rebinds that one
module function (nothing else of the model code) so CUDA tensors go to fla's kernel and every other
tensor to the reference, which refuses packed input rather than dropping its boundaries.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

CONV_NAME = "causal_conv1d_fn"
# transformers' reference convolution: hidden_states [B, D, T], weight [D, W] (qwen3_5, 5.17 to 5.25).
CONV_PARAMS = ("hidden_states", "weight", "bias", "activation")
FLA_ACTIVATIONS = (None, "silu", "swish")  # fla's kernel applies no other activation

# ----------------------------------------------------------------------------------------------
# The delta rule and other functions transformers binds to an external kernel


def _external_kernel(fn) -> tuple[Callable, Callable] | None:
    """(kernel, torch implementation) if `fn` is a transformers function bound to an external
    package's kernel (`use_kernel_func_from_hub_with_fallback` in transformers 5.17 to 5.24), else None."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not closure or not hasattr(fn, "__wrapped__"):
        return None
    cells = {}
    for name, cell in zip(code.co_freevars, closure, strict=True):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    kernel, reference = cells.get("implementation"), cells.get("torch_function", fn.__wrapped__)
    if cells.get("is_new_implementation") is not True or not callable(kernel) or not callable(reference):
        return None
    return kernel, reference


def _unwrap_func_module(fn):
    """With the `kernels` package installed (a dependency of transformers 5.25), transformers wraps
    such functions in a module whose forward calls the function it was made from: that function."""
    forward = getattr(type(fn), "forward", None)
    if isinstance(fn, nn.Module) and getattr(forward, "__closure__", None):
        cells = dict(zip(forward.__code__.co_freevars, forward.__closure__, strict=True))
        if "func" in cells and callable(cells["func"].cell_contents):
            return cells["func"].cell_contents
    return fn


def _kernel_takes(tensor: torch.Tensor) -> bool:
    """Whether the external Triton/CUDA kernels take this tensor: CUDA, 16- or 32-bit floats."""
    return tensor.device.type == "cuda" and tensor.dtype != torch.float64


def _routed(fn: Callable, reference: Callable) -> Callable:
    params = inspect.signature(reference).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(fn)
    def routed(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or _kernel_takes(first):
            return fn(*args, **kwargs)
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(
                f"{fn.__name__}: packed sequences need the CUDA kernel; the torch implementation cannot keep them apart"
            )
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return reference(*args, **kwargs)

    routed._dflash_routed = True
    return routed


def transformers_modules(model: nn.Module):
    """The transformers modules the model's layers come from (imported), in name order."""
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if module is not None and module_name.startswith("transformers."):
            yield module


def _module_functions(model: nn.Module):
    """(module, name, function) of the transformers modules the model's layers come from."""
    for module in transformers_modules(model):
        for name, fn in list(vars(module).items()):
            yield module, name, fn


def external_kernels(model: nn.Module) -> dict[str, str]:
    """{module.function: the external kernel it is bound to} for the model's transformers modules
    (e.g. fla's `chunk_gated_delta_rule`), routed or not; empty when transformers uses no such kernel."""
    found = {}
    for module, name, fn in _module_functions(model):
        fn = _unwrap_func_module(getattr(fn, "_dflash_inner", fn))  # through a project wrapper (recurrent_states)
        bound = _external_kernel(getattr(fn, "__wrapped__", None) if getattr(fn, "_dflash_routed", False) else fn)
        if bound is not None:
            kernel = bound[0]
            found[f"{module.__name__}.{name}"] = (
                f"{getattr(kernel, '__module__', '?')}.{getattr(kernel, '__qualname__', kernel)}"
            )
    return found


def route_kernels_by_device(model: nn.Module) -> list[str]:
    """Make the model's transformers modules call external kernels only for CUDA tensors.

    transformers picks e.g. fla's `chunk_gated_delta_rule` when its modeling module is imported, for
    every later call: CPU tensors then reach Triton ("Pointer argument ... cannot be accessed from
    Triton (cpu tensor?)"). Each such module function is replaced, once, by one that passes CPU and
    float64 tensors to transformers' own torch implementation (the one used without fla) and CUDA
    tensors to the kernel. Returns the functions routed now (empty when there are none or when done before).
    """
    done = []
    for module, name, fn in _module_functions(model):
        found = None if getattr(fn, "_dflash_routed", False) else _external_kernel(fn)
        if found is not None:
            setattr(module, name, _routed(fn, found[1]))
            done.append(f"{module.__name__}.{name}")
    if done:
        log.info("external kernels used for CUDA tensors only (torch implementation otherwise): %s", ", ".join(done))
    return done


# ----------------------------------------------------------------------------------------------
# The convolution: fla's kernel in place of transformers' reference one


def fla_causal_conv1d() -> Callable | None:
    """fla's Triton `causal_conv1d` (x [B, T, D], weight [D, W], ... -> (y, final_state)), or None."""
    for name in ("fla.modules.causal_conv1d", "fla.modules.convolution"):  # fla-core 0.6 / earlier releases
        try:
            fn = getattr(importlib.import_module(name), "causal_conv1d", None)
        except Exception:  # noqa: BLE001 - fla missing, or its Triton import failing on this host
            continue
        if callable(fn):
            return fn
    return None


def packed_boundaries(kwargs: dict) -> torch.Tensor | None:
    """The cumulative sample lengths a packed forward passes down (None: not packed)."""
    for key in ("cu_seq_lens_q", "cu_seqlens"):
        if kwargs.get(key) is not None:
            return kwargs[key]
    return None


def conv_via_fla(reference: Callable, kernel: Callable) -> Callable:
    """`reference` (transformers' causal_conv1d_fn) with CUDA tensors sent to fla's `kernel`, packed
    boundaries included; other tensors go to `reference`, which refuses packed input."""

    @functools.wraps(reference)
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu_seqlens = packed_boundaries(kwargs)
        if _kernel_takes(hidden_states) and activation in FLA_ACTIVATIONS:
            x_BTD = hidden_states.transpose(1, 2).contiguous()
            y_BTD, _ = kernel(x_BTD, weight, bias, activation=activation, cu_seqlens=cu_seqlens)
            return y_BTD.transpose(1, 2)
        if cu_seqlens is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(
                f"{CONV_NAME}: packed sequences need fla's CUDA kernel; the torch implementation cannot keep them apart"
            )
        return reference(hidden_states, weight, bias, activation=activation)

    conv._dflash_fla_conv = True
    conv._dflash_reference = reference
    return conv


def _reference_conv(fn) -> Callable | None:
    """The reference convolution behind transformers' `causal_conv1d_fn` when no external package is
    bound to it (with `causal-conv1d` installed, transformers' own choice stays)."""
    if not callable(fn) or getattr(fn, "_dflash_fla_conv", False):
        return None
    unwrapped = _unwrap_func_module(fn)
    if _external_kernel(unwrapped) is not None:
        return None
    inner = getattr(unwrapped, "__wrapped__", unwrapped)
    try:
        params = tuple(inspect.signature(inner).parameters)
    except (TypeError, ValueError):
        return None
    return fn if params[: len(CONV_PARAMS)] == CONV_PARAMS else None


def install_fla_convolution(model: nn.Module, kernel: Callable | None = None) -> list[str]:
    """Rebind the model's transformers `causal_conv1d_fn` to `conv_via_fla` where fla is importable
    (or `kernel` is given) and no external convolution is bound; the module functions rebound now."""
    kernel = kernel or fla_causal_conv1d()
    if kernel is None:
        return []
    done = []
    for module in transformers_modules(model):
        reference = _reference_conv(getattr(module, CONV_NAME, None))
        if reference is not None:
            setattr(module, CONV_NAME, conv_via_fla(reference, kernel))
            done.append(f"{module.__name__}.{CONV_NAME}")
    if done:
        log.info("fla's Triton causal_conv1d for CUDA tensors (reference convolution otherwise): %s", ", ".join(done))
    return done


def restore_reference_convolution(model: nn.Module) -> list[str]:
    """Undo `install_fla_convolution` (a benchmark's baseline): the module functions restored."""
    done = []
    for module in transformers_modules(model):
        fn = getattr(module, CONV_NAME, None)
        if getattr(fn, "_dflash_fla_conv", False):
            setattr(module, CONV_NAME, fn._dflash_reference)
            done.append(f"{module.__name__}.{CONV_NAME}")
    return done


def fla_convolution_installed(model: nn.Module) -> bool:
    return any(getattr(getattr(m, CONV_NAME, None), "_dflash_fla_conv", False) for m in transformers_modules(model))
