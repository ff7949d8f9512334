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
says why.

A hybrid target (Gated DeltaNet layers, `target.recurrent_states`) runs here too: the static cache
holds each such layer's recurrent state and convolution window in fixed buffers; a verify of T > 1
tokens records the state after every position (in the captured graph, the recorded tensors are graph
outputs at fixed addresses), and `keep` after a partial acceptance moves the count and copies the
states of the accepted length into the cache, replaying one small captured graph of copies per
accepted length. Each sequence starts from zeroed states. With `compile_mode`, a hybrid target's
decoder layers are compiled part by part, all but the Gated DeltaNet modules (whose recording runs
as Python while a graph is captured).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from target.load import Target
from target.recurrent_states import PerTokenStates, recurrent_mixers, zero_recurrent_states
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
        self.record: dict | None = None  # the per-token states the replay writes (hybrid targets, Q > 1)
        self.keeps: dict[int, torch.cuda.CUDAGraph] = {}  # accepted length -> the graph that keeps its states


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
        rollback: bool = True,
    ):
        super().__init__(target, layer_ids, stop_ids)
        from transformers import StaticCache

        if not rollback:  # a hybrid target's forwards without per-token states (a benchmark's reference)
            self.per_token = None

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

    def _fusable(self) -> list:
        """What `compile_mode` compiles: every decoder layer, or a hybrid target's layers part by part:
        all but their Gated DeltaNet modules, of which only the gated norms (a dozen elementwise kernels
        each, one fused)."""
        mixers = recurrent_mixers(self.target)[0]
        if not mixers:
            return list(self.target.layers)
        skip = set(map(id, mixers.values()))
        parts = [part for layer in self.target.layers for part in layer.children() if id(part) not in skip]
        return parts + [m for mixer in mixers.values() for m in mixer.children() if "Norm" in type(m).__name__]

    def _capture_all(self, sizes: list[int], compile_mode: str | None) -> str:
        if self.device.type != "cuda":
            return "off: CUDA graphs need a CUDA device"
        kept = f", per-token states of {len(self.per_token.mixers)} Gated DeltaNet layers" if self.per_token else ""
        fusion = ""
        if compile_mode:
            parts = self._fusable()
            what = "layers" if len(parts) == len(self.target.layers) else "layers but their Gated DeltaNet modules"
            try:
                with compiled_layers(parts, compile_mode, shapes=len(sizes)):
                    self._capture_sizes(sizes)
                return f"on for {sizes} new tokens{kept}, {what} compiled ({compile_mode})"
            except Exception as exc:  # noqa: BLE001 - the eager layers are captured instead, and the note says why
                fusion = f", layers not compiled ({_first_line(exc)})"
        try:
            self._capture_sizes(sizes)
        except Exception as exc:  # noqa: BLE001 - a model whose forward cannot be captured runs eagerly
            return f"off: capture failed ({_first_line(exc)}){fusion}"
        return f"on for {sizes} new tokens{kept}{fusion}"

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
                with self._recording(self._records(Q)):
                    self._run(g.ids_1Q, g.positions_Q, taps=True, last_only=False)
                self._take(Q, self._records(Q))  # checks the record
                self.placement.wrote(end + Q)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.placement.place(end)
        g.graph = torch.cuda.CUDAGraph()
        with self._recording(self._records(Q)), torch.cuda.graph(g.graph):
            g.logits_1QV, g.features_1QF = self._run(g.ids_1Q, g.positions_Q, taps=True, last_only=False)
        g.record = self._take(Q, self._records(Q))
        self.placement.wrote(end + Q)
        if g.record is not None:
            for kept in range(1, Q):  # a few copies per Gated DeltaNet layer each
                g.keeps[kept] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g.keeps[kept]):
                    PerTokenStates.keep(self.cache.layers, g.record, Q, kept)
        return g

    def _records(self, tokens: int) -> bool:
        """Whether a forward of `tokens` new tokens after a cached context keeps per-token states."""
        return self.per_token is not None and tokens > 1

    def _recording(self, on: bool):
        return self.per_token.recording(self.cache) if on else contextlib.nullcontext()

    def _take(self, tokens: int, on: bool) -> dict | None:
        return self.per_token.take(tokens) if on else None

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
        recorded = None
        if cache is None:
            zero_recurrent_states(self.cache)  # a new sequence starts from zeroed states
        if graph is None:
            on = cache is not None and self._records(T)  # not the prompt's forward
            with self._recording(on):
                logits, features = self._eager(ids_1T, start, taps=taps, last_only=last_only)
            recorded = (T, self._take(T, on), {}) if on else None
        else:
            self.placement.place(start)
            graph.ids_1Q.copy_(ids_1T, non_blocking=True)
            graph.positions_Q.copy_(torch.arange(start, start + T), non_blocking=True)
            graph.graph.replay()
            recorded = None if graph.record is None else (T, graph.record, graph.keeps)
            # Graph outputs are overwritten by the next replay: hand out copies.
            logits = graph.logits_1QV[:, -1:] if last_only else graph.logits_1QV
            logits, features = logits.clone(), graph.features_1QF.clone() if taps else None
        self.placement.wrote(start + T)
        handle = StaticKV(start + T)
        self.recorded = None if recorded is None else (handle, *recorded)
        return logits.float(), features, handle

    @torch.inference_mode()
    def keep(self, cache: StaticKV, kept: int) -> None:
        """As `SpecTarget.keep`, on the static cache: the count moved back, the Gated DeltaNet layers'
        states of the accepted length copied in (by a captured graph after a replayed verify)."""
        held, tokens, record, keeps = self.recorded
        assert held is cache, "keep() follows the recorded forward on the same cache"
        if tokens > kept:
            cache.crop(kept - tokens)
        if kept in keeps:
            keeps[kept].replay()
        else:
            PerTokenStates.keep(self.cache.layers, record, tokens, kept)
        self.recorded = None


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
