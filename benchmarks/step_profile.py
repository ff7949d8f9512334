"""Where a target's one-token step goes, beside the bound it cannot beat: the time of the step's kernels
per layer kind (Gated DeltaNet, attention, MLP, the output head, the rest), what the step's weights weigh
per kind, and the weight-streaming bound (every weight read once per step: bytes / the GPU's memory
bandwidth). A part of `benchmarks.spec_round` (a benchmark, not a test).

How: forward hooks open a `torch.profiler.record_function` range around each layer kind's modules, and
`torch.profiler` records a few eager one-token steps on a static cache; each kernel counts for the range
that launched it. A graphed step replays the same kernels without their launch cost, so the measured
graphed step minus the kernels' sum is what launches and idle gaps still cost inside the graph. On a CPU
(the smoke scale) there are no kernels: the ranges' CPU time stands in, and no bound is printed.

Bandwidth by GPU name (vendor figures, TB/s): `BANDWIDTH`; an unknown GPU prints no bound.
"""

from __future__ import annotations

import torch
from torch import nn

from target.recurrent_states import recurrent_mixers

KINDS = ("Gated DeltaNet", "attention", "MLP", "head", "other")
# (substring of torch.cuda.get_device_name(), bytes/s), the first match wins: the specific names first.
BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM, HBM3 (the "H100 80GB HBM3" of the device)
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("B200", 8.0e12),
    ("L40S", 0.864e12),
)


def bandwidth_for(gpu_name: str) -> float | None:
    """The GPU's memory bandwidth in bytes/s, by its name; None for a name not in `BANDWIDTH`."""
    return next((bw for key, bw in BANDWIDTH if key in gpu_name), None)


def kind_modules(target) -> dict[str, list[nn.Module]]:
    """{kind: the modules whose work is that kind's}: each decoder layer's Gated DeltaNet module, its
    attention module (a child named *attn* that is not recurrent), its MLP (a child named mlp), and the head."""
    mixers = set(map(id, recurrent_mixers(target)[0].values()))
    found: dict[str, list[nn.Module]] = {kind: [] for kind in KINDS[:-1]}
    for layer in target.layers:
        for name, child in layer.named_children():
            if id(child) in mixers:
                found["Gated DeltaNet"].append(child)
            elif "attn" in name:
                found["attention"].append(child)
            elif name in ("mlp", "feed_forward", "block_sparse_moe"):
                found["MLP"].append(child)
    found["head"].append(target.lm_head)
    return found


def weight_bytes(target) -> dict[str, int]:
    """{kind: bytes of the weights one step reads}: every parameter but the input embedding table (one row
    of it is read), unless the head shares it."""
    counted: set[int] = set()
    out = {}
    for kind, modules in kind_modules(target).items():
        out[kind] = sum(p.numel() * p.element_size() for m in modules for p in m.parameters() if _first(p, counted))
    embedding = target.decoder.get_input_embeddings().weight
    if embedding is not target.lm_head.weight:
        counted.add(id(embedding))
    out["other"] = sum(p.numel() * p.element_size() for p in target.model.parameters() if _first(p, counted))
    return out


def _first(p: torch.Tensor, counted: set[int]) -> bool:
    if id(p) in counted:
        return False
    counted.add(id(p))
    return True


class KindRanges:
    """Forward hooks that open a profiler range named after its kind around each kind's modules."""

    def __init__(self, target):
        self.handles, self.open = [], []
        for kind, modules in kind_modules(target).items():
            for module in modules:
                self.handles.append(module.register_forward_pre_hook(lambda m, a, kind=kind: self._enter(kind)))  # noqa: ARG005 (hook signature)
                self.handles.append(module.register_forward_hook(lambda m, a, o: self._exit()))  # noqa: ARG005 (hook signature)

    def _enter(self, kind: str) -> None:
        scope = torch.profiler.record_function(kind)
        scope.__enter__()
        self.open.append(scope)

    def _exit(self) -> None:
        self.open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _kernel_time(event) -> tuple[float, int]:
    """(µs, count) of the kernels `event` and the ops under it launched."""
    total, count = sum(k.duration for k in event.kernels), len(event.kernels)
    for child in event.cpu_children:
        t, n = _kernel_time(child)
        total, count = total + t, count + n
    return total, count


@torch.inference_mode()
def profile_steps(spec, prompt: list[int], steps: int = 5) -> dict:
    """Per kind: the step's kernel time (ms) and kernel count, from `steps` eager one-token forwards of
    `spec` (a `StaticSpecTarget` without graphs, or any `SpecTarget`) after `prompt`; on a CPU, the
    ranges' CPU time. Also the sum over all kernels ("all")."""
    from torch.profiler import ProfilerActivity, profile

    cuda = spec.device.type == "cuda"
    _, _, cache = spec.forward(torch.tensor([prompt]), None, taps=False, last_only=True)
    for _ in range(2):  # warm-up
        _, _, cache = spec.forward(torch.tensor([[5]]), cache, taps=True)
    ranges = KindRanges(spec.target)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                _, _, cache = spec.forward(torch.tensor([[5]]), cache, taps=True)
            if cuda:
                torch.cuda.synchronize()
    finally:
        ranges.remove()
    events = prof.events()
    out = {kind: {"ms": 0.0, "kernels": 0} for kind in KINDS}
    for event in events:
        if event.name in out and event.name != "other":
            t, n = _kernel_time(event) if cuda else (event.cpu_time_total, 0)
            out[event.name]["ms"] += t / 1e3 / steps
            out[event.name]["kernels"] += n / steps
    if cuda:
        all_us = sum(k.duration for e in events for k in e.kernels)
        all_n = sum(len(e.kernels) for e in events)
        out["all"] = {"ms": all_us / 1e3 / steps, "kernels": all_n / steps}
        out["other"] = {
            "ms": out["all"]["ms"] - sum(out[k]["ms"] for k in KINDS[:-1]),
            "kernels": out["all"]["kernels"] - sum(out[k]["kernels"] for k in KINDS[:-1]),
        }
    return out


def breakdown(spec, prompt: list[int], step_ms: float | None, device_name: str, steps: int = 5) -> dict:
    """The step's kernels per kind (over `steps` profiled steps), the weights per kind and the
    weight-streaming bound beside the measured graphed step `step_ms`."""
    kinds = profile_steps(spec, prompt, steps)
    weights = weight_bytes(spec.target)
    bandwidth = bandwidth_for(device_name) if spec.device.type == "cuda" else None
    out = {"kinds": kinds, "weight_bytes": weights, "bandwidth": bandwidth, "step_ms": step_ms}
    if bandwidth:
        out["bound_ms"] = sum(weights.values()) / bandwidth * 1e3
        out["kind_bound_ms"] = {k: b / bandwidth * 1e3 for k, b in weights.items()}
        if isinstance(step_ms, float):
            out["step_over_bound"] = step_ms / out["bound_ms"]
    if isinstance(step_ms, float) and "all" in kinds:
        out["launches_idle_ms"] = step_ms - kinds["all"]["ms"]
    return out


def format_breakdown(found: dict) -> str:
    if "error" in found:
        return f"one-token step breakdown: {found['error']}"
    bw = found.get("bandwidth")
    kinds, weights, bounds = found["kinds"], found["weight_bytes"], found.get("kind_bound_ms", {})
    time_of = "kernel time" if "all" in kinds else "CPU time (no GPU: no kernels)"
    lines = [
        "one-token step by layer kind (torch.profiler over eager steps):",
        f"  {'kind':<16}{'weights':>10}{'bound':>10}{time_of:>30}{'kernels':>9}",
    ]
    for kind in KINDS:
        bound = f"{bounds[kind]:.2f} ms" if kind in bounds else "-"
        lines.append(
            f"  {kind:<16}{weights.get(kind, 0) / 1e9:>7.2f} GB{bound:>10}{kinds[kind]['ms']:>27.3f} ms"
            f"{kinds[kind]['kernels']:>9.0f}"
        )
    if "all" in kinds:
        lines.append(f"  {'all kernels':<36}{kinds['all']['ms']:>27.3f} ms{kinds['all']['kernels']:>9.0f}")
    if "launches_idle_ms" in found:
        lines.append(
            f"  graphed step {found['step_ms']:.3f} ms = kernels {kinds['all']['ms']:.3f} ms + launches and idle "
            f"{found['launches_idle_ms']:.3f} ms"
        )
    total = sum(weights.values())
    if bw:
        lines.append(
            f"  weight-streaming bound: {total / 1e9:.2f} GB / {bw / 1e12:.2f} TB/s = {found['bound_ms']:.2f} ms"
            + (f"; graphed step / bound = {found['step_over_bound']:.2f}x" if "step_over_bound" in found else "")
        )
    else:
        lines.append(f"  weight-streaming bound: {total / 1e9:.3f} GB of weights; no bandwidth known for this device")
    return "\n".join(lines)
