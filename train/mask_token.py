"""Which mask token the drafter trains with, and where it came from (`resolve_mask_token`): the
shards' provenance (extraction chose it and rejected every sample that holds it), else the target
tokenizer's `mask_token`, else the config's `model.mask_token_id`. A token the shards' provenance
does not vouch for is looked for in every sample's input_ids (`check_mask_token_absent`)."""

from __future__ import annotations

import dataclasses
import enum
import logging

from shards.provenance import MaskSource, Provenance

log = logging.getLogger(__name__)


class MaskOrigin(enum.Enum):
    """Where training took the mask token id from; its value is how run.json names it."""

    SHARDS = "shards provenance tokenizer.mask_token_id"
    TOKENIZER = "target tokenizer mask_token"
    CONFIG = "config model.mask_token_id"


@dataclasses.dataclass(frozen=True)
class MaskTokenChoice:
    token_id: int
    origin: MaskOrigin
    how: MaskSource | None = None  # from the shards: how extraction chose it (None: not recorded)

    def describe(self) -> str:
        """run.json's `mask_token_source`, e.g. "shards provenance tokenizer.mask_token_id (auto)"."""
        return self.origin.value + (f" ({self.how})" if self.how else "")


def resolve_mask_token(provenance: Provenance, tokenizer, configured: int | None) -> MaskTokenChoice:
    """The mask token: the shards' provenance, else the target tokenizer's mask token, else the
    config. A configured id that contradicts the chosen source is refused: the drafter must be
    trained with the id the serving side will put into its blocks.
    """
    recorded = provenance.tokenizer.mask_token_id
    tok_id = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if recorded is not None:
        found = MaskTokenChoice(int(recorded), MaskOrigin.SHARDS, provenance.tokenizer.mask_token.source)
    elif tok_id is not None:
        found = MaskTokenChoice(int(tok_id), MaskOrigin.TOKENIZER)
    elif configured is not None:
        return MaskTokenChoice(configured, MaskOrigin.CONFIG)
    else:
        raise ValueError(
            "no mask token id: the shards' provenance has no tokenizer.mask_token_id, the target tokenizer defines no "
            "mask_token, and config key 'model.mask_token_id' is not set"
        )
    if configured is not None and configured != found.token_id:
        raise ValueError(
            f"config key 'model.mask_token_id' = {configured} contradicts the {found.describe()} = {found.token_id}"
        )
    return found


def check_mask_token_absent(dataset, mask: MaskTokenChoice) -> None:
    """ValueError naming the setting if a sample holds the mask token (the drafter would read it both
    as a real token and as the mask). The shards' own mask token is absent by construction: extraction
    rejects every sample that holds it. Any other id is looked for in the input_ids of every shard."""
    if mask.origin is MaskOrigin.SHARDS:
        return
    log.info("mask token id %d (%s): checking that no sample of the shards holds it", mask.token_id, mask.describe())
    held = dataset.samples_holding(mask.token_id)
    if held:
        where = (
            "config key 'model.mask_token_id'"
            if mask.origin is MaskOrigin.CONFIG
            else "the target tokenizer's mask_token"
        )
        raise ValueError(
            f"{where} = {mask.token_id} occurs in the shards' input_ids (samples {', '.join(held)}); the mask "
            "token must never occur in the data: set model.mask_token_id to an id the data does not hold, or extract "
            "again (extraction chooses one and records it in the provenance)"
        )
