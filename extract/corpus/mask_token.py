"""The token DFlash fills draft positions with, for targets whose tokenizer defines none.

DFlash feeds the drafter a block [x_anchor, MASK x (B-1)]; the mask token's embedding is the
target's, so any id of the vocabulary works, as long as it never occurs in the data (a drafter
that saw it as a real token would read it both ways). The choice, in this order:

1. `mask_token_id` in the extraction config (source "config");
2. the tokenizer's own `mask_token` (source "tokenizer");
3. automatic (source "auto"): the lowest id among the tokenizer's special tokens that are not its
   eos / bos / pad / unk token, that the chat template does not write, and that no record of the
   corpus holds.

Why the third rule proves absence: record text is never tokenized into special tokens (`rendering`
keeps record text from forging control tokens), the chat template's own special tokens are
excluded, so only ready-tokenized records (`input_ids`) can hold a special token, and those are
scanned (`corpus_token_ids`). A configured or tokenizer mask token that some ready-tokenized record holds is
refused; one that is not a special token (text can produce it) is allowed with a warning, and every
sample that holds it is rejected (`holds_mask_token`), so no stored sample ever holds the mask token.
SmolLM2's tokenizer, for instance, has 17 special tokens: `<|endoftext|>` (unk), `<|im_start|>` (bos),
`<|im_end|>` (eos, pad), which the template writes, and 14 that it does not (`<repo_name>` = 3 first).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import numpy as np

from extract.corpus.files import CorpusFiles
from extract.corpus.reading import token_id_lists
from extract.corpus.rendering import control_token_ids
from shards.provenance import MaskSource, MaskToken

log = logging.getLogger(__name__)

# A conversation of every role the chat template knows, rendered to find the special tokens it writes.
_PROBE = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
    {"role": "user", "content": "v"},
]


@dataclasses.dataclass(frozen=True)
class MaskChoice:
    token_id: int | None
    token: str | None
    source: MaskSource
    passed_over: tuple[int, ...] = ()  # auto: candidates skipped because the corpus holds them

    def record(self) -> MaskToken:
        """What the shards' provenance records besides `tokenizer.mask_token_id`."""
        return MaskToken(self.token, self.source, self.passed_over)

    def describe(self) -> str:
        if self.token_id is None:
            return "no mask token (the tokenizer has none and none could be chosen)"
        why = {
            MaskSource.CONFIG: "set by mask_token_id",
            MaskSource.TOKENIZER: "the tokenizer's mask_token",
            MaskSource.AUTO: "chosen automatically: a special token that neither the chat template nor the corpus "
            "holds",
        }[self.source]
        skipped = f"; skipped {list(self.passed_over)}, which the corpus holds" if self.passed_over else ""
        return f"mask token {self.token!r} = id {self.token_id} ({why}{skipped})"


def template_token_ids(tokenizer) -> set[int]:
    """Special-token ids the chat template writes (with and without a generation prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    ids: set[int] = set()
    for messages, prompt in ((_PROBE, True), (_PROBE[:3], False)):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        except Exception:  # noqa: BLE001 - a template that refuses the probe (e.g. no system role)
            text = tokenizer.apply_chat_template(
                [m for m in messages if m["role"] != "system"], tokenize=False, add_generation_prompt=prompt
            )
        ids.update(int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"])
    return ids


def mask_token_candidates(tokenizer) -> list[int]:
    """Special-token ids that text never produces and the template never writes, ascending."""
    reserved = {getattr(tokenizer, f"{name}_token_id", None) for name in ("eos", "bos", "pad", "unk")}
    excluded = {int(i) for i in reserved if i is not None} | template_token_ids(tokenizer)
    return sorted(i for i in control_token_ids(tokenizer) if i not in excluded)


def corpus_token_ids(corpora: Iterable[CorpusFiles], wanted: Iterable[int]) -> set[int]:
    """The ids of `wanted` that some ready-tokenized record (`input_ids`) of the corpora holds."""
    wanted_arr = np.asarray(sorted(set(wanted)), dtype=np.int64)
    found: set[int] = set()
    if not wanted_arr.size:
        return found
    for corpus in corpora:
        for ids in token_id_lists(corpus):
            if isinstance(ids, (str, bytes)):
                continue
            try:
                arr = np.asarray(ids)
            except (TypeError, ValueError):
                continue  # a malformed record is rejected by extraction itself
            if arr.ndim == 1 and arr.dtype.kind in "iu":
                found.update(int(i) for i in wanted_arr[np.isin(wanted_arr, arr)])
    return found


def choose_mask_token(tokenizer, configured: int | None, corpora: list[CorpusFiles]) -> MaskChoice:
    """The mask token for these corpora (see the module docstring); ValueError naming `mask_token_id`
    when a configured or tokenizer mask token could occur in the data."""
    special = control_token_ids(tokenizer)
    if configured is not None:
        given = (configured, MaskSource.CONFIG)
    else:
        given = (getattr(tokenizer, "mask_token_id", None), MaskSource.TOKENIZER)
    if given[0] is not None:
        token_id, source = int(given[0]), given[1]
        where = "config key 'mask_token_id'" if source is MaskSource.CONFIG else "the tokenizer's mask_token"
        if token_id not in special:
            log.warning(
                "%s = %d (%r) is not a special token: record text can produce it, and each sample that holds it "
                "is rejected (holds_mask_token); a special token the data never holds loses nothing",
                where,
                token_id,
                _text(tokenizer, token_id),
            )
        if corpus_token_ids(corpora, [token_id]):
            raise ValueError(
                f"{where} = {token_id} ({_text(tokenizer, token_id)!r}) occurs in the corpus's input_ids; "
                "set mask_token_id to another special token, or leave it unset (chosen automatically)"
            )
        return MaskChoice(token_id, _text(tokenizer, token_id), source)
    candidates = mask_token_candidates(tokenizer)
    held = corpus_token_ids(corpora, candidates)
    for token_id in candidates:
        if token_id not in held:
            passed = tuple(i for i in candidates if i < token_id)
            return MaskChoice(token_id, _text(tokenizer, token_id), MaskSource.AUTO, passed)
    return MaskChoice(None, None, MaskSource.NONE, tuple(candidates))


def _text(tokenizer, token_id: int) -> str:
    return tokenizer.convert_ids_to_tokens(int(token_id))
