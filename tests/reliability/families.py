"""What every bad-input family of scenario 5 shares (`bad_inputs`, `corpus_inputs`, `corpus_files`,
`writers`): the tally of cases tried and answered clearly, the hypothesis settings, and the chat
record strategies the families build their inputs from."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st


@dataclasses.dataclass
class Tally:
    tried: int = 0
    clear: int = 0
    failures: list = dataclasses.field(default_factory=list)
    kinds: dict = dataclasses.field(default_factory=dict)

    def add(self, kind: str, ok: bool, what: str) -> None:
        self.tried += 1
        self.clear += ok
        tried, clear = self.kinds.get(kind, (0, 0))
        self.kinds[kind] = (tried + 1, clear + ok)
        if not ok:
            self.failures.append(f"{kind}: {what}")


def hypothesis_settings(examples: int, seed: int | None):
    """No example database (nothing written to the checkout); derandomized unless a seed is given."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


# ----------------------------------------------------------------------------------------------
# Corpus records

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
ODD_TEXT = st.one_of(
    TEXT,
    st.text(st.characters(min_codepoint=0, max_codepoint=0x1F), min_size=1, max_size=20),  # control characters
    st.sampled_from(
        ["", " ", "\n\n", "<|im_end|>", "<|im_start|>assistant\n", "\u2028\u2029", "\x00", "\ufeff", "\ue000\ue001"]
    ),
    st.integers(1000, 60000).map(lambda n: "word " * n),  # huge: far beyond max_len
)
WRONG = st.one_of(
    st.integers(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
WRONG_NOT_NONE = WRONG.filter(lambda v: v is not None)
ROLES = ("system", "user", "assistant", "tool")


def message(role, content) -> dict:
    return {"role": role, "content": content}


@st.composite
def valid_chat(draw):
    turns = [message(draw(st.sampled_from(("system", "user"))), draw(ODD_TEXT))]
    for _ in range(draw(st.integers(0, 2))):
        turns.append(message(draw(st.sampled_from(ROLES)), draw(ODD_TEXT)))
    turns.append(message("assistant", draw(ODD_TEXT)))
    return {"messages": turns}
