"""Where a greedy answer starts looping: `RepeatWatch`, shared by the tiny build's regeneration
(`recipes.tiny`, which cuts the target's answers there) and speculative decoding
(`train.serve.specdecode --stop-repeat`, which stops there), so that both end a response at the same token.

A response loops once its last n tokens repeat the p tokens before them (token i equals token
i - p for each of the last n) for some period p <= `REPEAT_MAX_PERIOD`, with n >= max(p,
min_repeat): one whole period repeated, and never fewer than `min_repeat` tokens. The response
keeps that first repetition and ends after it.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Longest loop period looked for. The tiny target's loops repeat a clause or a line (periods of
# 4 to 14 tokens typically); real documentation text almost never repeats 16 tokens in a row
# (3 of the 1,406 answers of the tiny corpus; none repeats 24).
REPEAT_MAX_PERIOD = 64


class RepeatWatch:
    """Notices, token by token and for a batch of rows at once, where each row starts looping.

    For each period p, the length of the current run of tokens equal to the token p back is kept
    and updated per step: one vectorized comparison per step, whatever the batch.
    """

    def __init__(self, rows: int, max_tokens: int, min_repeat: int, max_period: int = REPEAT_MAX_PERIOD):
        import torch

        if min_repeat < 1 or max_period < 1:
            raise ValueError(f"min_repeat and max_period must be >= 1, got {min_repeat} and {max_period}")
        self.history_RN = torch.zeros(rows, max_tokens, dtype=torch.long)
        self.runs_RP: torch.Tensor = torch.zeros(
            rows, max_period, dtype=torch.long
        )  # column p-1: current run at period p
        self.needed_P = torch.arange(1, max_period + 1).clamp(min=min_repeat)
        self.length = 0

    def push(self, next_ids: list[int]) -> list[bool]:
        """Append one token per row; True for each row that loops now."""
        import torch

        step, new_R = self.length, torch.tensor(next_ids, dtype=torch.long)
        if step >= self.history_RN.shape[1]:
            raise ValueError(f"RepeatWatch holds {self.history_RN.shape[1]} tokens per row; one more was pushed")
        self.history_RN[:, step] = new_R
        span = min(step, self.runs_RP.shape[1])
        if span:
            back_RP = self.history_RN[:, step - span : step].flip(1)  # column p-1: the token p steps back
            self.runs_RP[:, :span] = (self.runs_RP[:, :span] + 1) * (back_RP == new_R[:, None])
        self.length += 1
        return (self.runs_RP >= self.needed_P).any(1).tolist()

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows (by index), in this order: the batch dropped the others."""
        self.history_RN, self.runs_RP = self.history_RN[rows], self.runs_RP[rows]
