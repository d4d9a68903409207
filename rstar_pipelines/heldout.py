"""The held-out split, declared once (`heldout:` in pipeline.yaml) and read by the loader of the
declared pipeline and by every stage that trains or evaluates; `problems` selects the problems on
either side of it and checks training tables against it.

The split is by seed: a seed problem and every problem synthesized from it fall on the same side.
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field


class HeldoutSplit(BaseModel):
    """A fixed split by seed id: a seed is held out when the hash of the salt and its id falls
    below `fraction`. Changing the salt or the fraction draws another split (and marks every
    asset that reads it stale)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fraction: float = Field(0.2, ge=0, lt=1, description="share of seeds kept for evaluation")
    salt: str = Field("rstar-heldout-1", min_length=1, description="names this draw of the split")

    def is_heldout(self, seed_id: str) -> bool:
        digest = hashlib.sha256(f"{self.salt}\x00{seed_id}".encode()).hexdigest()
        return int(digest[:8], 16) / 16**8 < self.fraction
