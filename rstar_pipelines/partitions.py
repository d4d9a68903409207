"""Partitionings the declared pipeline may name."""

from __future__ import annotations

import dagster as dg

# One partition per seed batch file; added by the seed-file sensor or `rstar seeds add`.
seed_batches = dg.DynamicPartitionsDefinition(name="seed_batches")

PARTITIONINGS: dict[str, dg.PartitionsDefinition | None] = {
    "seed_batches": seed_batches,
    "none": None,
}
