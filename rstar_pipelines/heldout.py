"""The held-out split, declared once (`heldout:` in pipeline.yaml) and read by the loader of the
declared pipeline and by every stage that trains or evaluates; `problems` selects the problems on
either side of it and checks training tables against it.

The split draws groups of near-duplicates (`problem_groups`): a seed, every problem synthesized
from it, and the same or similar problems of every batch fall on one side. The normalizations that
find them are here too.
"""

from __future__ import annotations

import hashlib
import unicodedata
from decimal import Decimal, InvalidOperation

from pydantic import BaseModel, ConfigDict, Field


class HeldoutSplit(BaseModel):
    """A fixed split by near-duplicate group: a group is held out when the hash of the salt and
    its key falls below `fraction`. Changing the salt, the fraction or the similarity draws another
    split (and marks every asset that reads it stale)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fraction: float = Field(0.2, ge=0, lt=1, description="share of seeds kept for evaluation")
    salt: str = Field("rstar-heldout-1", min_length=1, description="names this draw of the split")
    similarity: float = Field(
        0.9,
        gt=0,
        le=1,
        description="problems of one domain whose normalized texts are at least this similar "
        "(rapidfuzz's ratio, 0 to 1) and whose answers do not differ are near-duplicates",
    )

    def is_heldout(self, group: str) -> bool:
        """Whether a group (the key `problem_groups` gives it: its smallest seed id) is held out."""
        digest = hashlib.sha256(f"{self.salt}\x00{group}".encode()).hexdigest()
        return int(digest[:8], 16) / 16**8 < self.fraction

    def describe(self) -> str:
        return f"fraction {self.fraction}, salt {self.salt!r}, similarity {self.similarity}"


# Operators stay: "x-1" and "x 1", "-5" and "5", "3/8" and "3 8" are different problems.
_KEPT_PUNCTUATION = frozenset("-/*%")


def normalized_text(text: str) -> str:
    """A problem's text as near-duplicates share it: case, spacing and punctuation dropped."""
    text = unicodedata.normalize("NFKC", text).casefold()
    # Punctuation becomes a space rather than nothing, so "3.5" and "35" stay apart.
    text = "".join(
        " " if unicodedata.category(c).startswith("P") and c not in _KEPT_PUNCTUATION else c
        for c in text
    )
    return " ".join(text.split())


def normalized_answer(answer: str | None) -> str | None:
    """An answer as equal answers share it: a number in its shortest decimal form ("5.0",
    "5", "5.00" and "1,000" / "1000"), any other text with spacing and case dropped."""
    if answer is None or not answer.strip():
        return None
    text = unicodedata.normalize("NFKC", answer).strip().strip("$").rstrip(".")
    try:
        number = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return " ".join(text.casefold().split())
    return format(number.normalize(), "f") if number.is_finite() else text.casefold()
