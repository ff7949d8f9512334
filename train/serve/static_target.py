"""The target on a static KV cache, with its one-token and block-sized forwards replayed as CUDA graphs:
what makes a small target's decoding fast where it is bound by kernel launches (a 135 M model on a
GPU runs ~1,000 kernels per forward, each costing more to launch than to run).

`StaticSpecTarget` is a `SpecTarget` whose cache is a transformers `StaticCache` of fixed length,
allocated once. A cache "handle" (`StaticKV`) only counts the filled positions: cutting it back after a
partial acceptance moves the count, and the next forward writes over the rejected positions (the
causal mask, built from the positions, never lets a query see a key past itself, so stale entries
beyond the count are never read). The prompt's forward runs eagerly (its length varies); the forwards
of 1 and of `block_size` new tokens are captured once as CUDA graphs and replayed with the new token
ids and positions copied into their input buffers. The tap features come from the same hooks as the
eager path (`SpecTarget.call_model`: layer id i = output of decoder layer i), recorded during capture.

With `compile_mode` (train.serve.fusion.COMPILE_MODES), each decoder layer is compiled while the
graphs are warmed up and captured, so a replay runs fused kernels; if that fails, the graphs are
captured from the eager layers and the note says why. Where a graph cannot be captured (no CUDA, or a model
whose forward synchronizes with the host), the same static-cache forwards run eagerly, and `graphs`
says why. Targets with recurrent layers (Gated
DeltaNet) are not supported here: their state cannot be cut back by moving a count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from target.load import Target
from target.static_cache import CachePlacement
from train.serve.fusion import compiled_layers
from train.serve.spec_target import SpecTarget


class StaticKV:
    """The positions of a `StaticCache` that hold this sequence's keys and values (0 .. n-1)."""

    is_croppable = True

    def __init__(self, n: int):
        self.n = n

    def get_seq_length(self) -> int:
        return self.n

    def crop(self, length: int) -> None:
        assert length < 0, length  # spec_target.crop_cache passes the number of positions to drop
        self.n += length


class _Graph:
    """One captured forward of Q new tokens: static inputs, outputs, and the graph."""

    def __init__(self, Q: int, device):
        self.Q = Q
        self.ids_1Q = torch.zeros((1, Q), dtype=torch.long, device=device)
        self.positions_Q = torch.zeros(Q, dtype=torch.long, device=device)
        self.graph = None
        self.logits_1QV = None
        self.features_1QF = None


class StaticSpecTarget(SpecTarget):
    """A `SpecTarget` on a static cache of `max_len` positions, CUDA graphs for forwards of `graph_sizes` tokens."""

    def __init__(
        self,
        target: Target,
        layer_ids: Sequence[int],
        stop_ids: Sequence[int],
        *,
        max_len: int,
        graph_sizes: Sequence[int] = (1, 16),
        graphs: bool = True,
        compile_mode: str | None = None,
    ):
        super().__init__(target, layer_ids, stop_ids)
        from transformers import StaticCache

        self.max_len = int(max_len)
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        self.placement = CachePlacement(self.model, self.cache)  # where the next forward writes its keys
        self.graphs: dict[int, _Graph] = {}
        self.graph_note = "off"
        self._prime()
        if graphs:
            self.graph_note = self._capture_all(sorted(set(int(q) for q in graph_sizes)), compile_mode)

    # -- setup ------------------------------------------------------------------------------

    def _prime(self) -> None:
        """One eager forward: the cache allocates its tensors (graphs capture their addresses)."""
        self._eager(torch.zeros((1, 1), dtype=torch.long, device=self.device), 0, taps=True, last_only=False)

    def _capture_all(self, sizes: list[int], compile_mode: str | None) -> str:
        if self.device.type != "cuda":
            return "off: CUDA graphs need a CUDA device"
        fusion = ""
        if compile_mode:
            try:
                with compiled_layers(self.target.layers, compile_mode, shapes=len(sizes)):
                    self._capture_sizes(sizes)
                return f"on for {sizes} new tokens, layers compiled ({compile_mode})"
            except Exception as exc:  # noqa: BLE001 - the eager layers are captured instead, and the note says why
                fusion = f", layers not compiled ({_first_line(exc)})"
        try:
            self._capture_sizes(sizes)
        except Exception as exc:  # noqa: BLE001 - a model whose forward cannot be captured runs eagerly
            return f"off: capture failed ({_first_line(exc)}){fusion}"
        return f"on for {sizes} new tokens{fusion}"

    def _capture_sizes(self, sizes: list[int]) -> None:
        try:
            for Q in sizes:
                self.graphs[Q] = self._capture(Q)
        except Exception:
            self.graphs.clear()
            torch.cuda.synchronize(self.device)
            raise

    @torch.inference_mode()
    def _capture(self, Q: int) -> _Graph:
        g = _Graph(Q, self.device)
        # Capture at the end of the cache: the warm-up and capture runs write there, where no sequence reaches.
        end = self.max_len - Q
        g.positions_Q.copy_(torch.arange(end, self.max_len, device=self.device))
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.placement.place(end)
                self._run(g.ids_1Q, g.positions_Q, taps=True, last_only=False)
                self.placement.wrote(end + Q)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.placement.place(end)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph):
            g.logits_1QV, g.features_1QF = self._run(g.ids_1Q, g.positions_Q, taps=True, last_only=False)
        self.placement.wrote(end + Q)
        return g

    # -- forwards -----------------------------------------------------------------------------

    def _run(self, ids_1T: torch.Tensor, positions_T: torch.Tensor, *, taps: bool, last_only: bool):
        kwargs = {"input_ids": ids_1T, self.cache_kwarg: self.cache, "use_cache": True}
        kwargs["position_ids"] = positions_T[None]
        kwargs.update(self.placement.kwargs(positions_T))
        if last_only:
            kwargs["logits_to_keep"] = 1
        out, features_1TF = self.call_model(kwargs, taps=taps)
        return out.logits, features_1TF

    def _eager(self, ids_1T: torch.Tensor, start: int, *, taps: bool, last_only: bool):
        self.placement.place(start)
        positions = torch.arange(start, start + ids_1T.shape[1], device=self.device)
        out = self._run(ids_1T.to(self.device), positions, taps=taps, last_only=last_only)
        self.placement.wrote(start + ids_1T.shape[1])
        return out

    @torch.inference_mode()
    def forward(
        self,
        ids_1T: torch.Tensor,
        cache=None,
        *,
        taps: bool = True,
        last_only: bool = False,
        position_ids_1T: torch.Tensor | None = None,
        mask_11TK: torch.Tensor | None = None,
    ):
        """As `SpecTarget.forward`, on the static cache: `cache` None starts a sequence (the prompt)."""
        if position_ids_1T is not None or mask_11TK is not None:
            raise ValueError("the static-cache target has no tree verification (DDTree): use the dynamic cache")
        T = ids_1T.shape[1]
        start = 0 if cache is None else cache.get_seq_length()
        if start + T > self.max_len:
            raise ValueError(f"sequence of {start + T} positions exceeds the static cache of {self.max_len}")
        graph = self.graphs.get(T) if cache is not None else None
        if graph is None:
            logits, features = self._eager(ids_1T, start, taps=taps, last_only=last_only)
        else:
            self.placement.place(start)
            graph.ids_1Q.copy_(ids_1T, non_blocking=True)
            graph.positions_Q.copy_(torch.arange(start, start + T), non_blocking=True)
            graph.graph.replay()
            # Graph outputs are overwritten by the next replay: hand out copies.
            logits = graph.logits_1QV[:, -1:] if last_only else graph.logits_1QV
            logits, features = logits.clone(), graph.features_1QF.clone() if taps else None
        self.placement.wrote(start + T)
        return logits.float(), features, StaticKV(start + T)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def static_cache_length(prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int, limit: int) -> int:
    """Positions the static cache needs for every prompt: the longest prompt, the new tokens, one
    block of drafts past them and one block for the graphs' own capture runs, rounded up to 256."""
    need = max((len(p) for p in prompts), default=0) + max_new_tokens + 2 * block_size
    need = -(-need // 256) * 256
    if need > limit:
        raise ValueError(f"the prompts need {need} cache positions, more than the target's {limit}")
    return need
