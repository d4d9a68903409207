"""A key/value cache that appends in place and keeps what rows share once, for the transformers
backend's decode calls.

transformers' DynamicLayer appends each step's keys and values with `torch.cat`, which copies the
whole cache every step: for 16 rows over an 800-token context on the embedded model that is
about 1.2 GB moved per generated token, more than the model's weights. `PreallocatedLayer` keeps
them in a buffer sized for the whole call (prompt width + max new tokens, known before the
first step) and hands attention a view of the filled part, so a step writes one token per row.

With `share_repeats` (for models whose attention reads a shared part, module
`cascade_attention`), repeating the batch copies nothing: what each row holds then (a prompt's
keys, before its n samples; a batch's shared preamble, before its prompts) becomes the shared
part of a group of rows, kept once, and each row's later keys go to its own part. Every decode
step of n samples of a prompt reads one copy of the prompt's keys, not n.

The layer is a DynamicLayer in every other respect (cropping, batch repeats and selections,
resets): those replace `keys`/`values` with tensors of their own, and the next update moves them
back into a buffer. Only plain full-attention layers are replaced; sliding-window and other
layers keep their own classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


@dataclass(frozen=True)
class RowGroups:
    """Which rows share which shared part: rows of a group are contiguous, groups in order."""

    group_of_row: torch.Tensor  # [rows]
    first_row: torch.Tensor  # [groups]: each group's first row
    slot: torch.Tensor  # [rows]: each row's place in its group
    width: int  # the rows of the largest group
    uniform: bool  # whether every group has `width` rows

    @classmethod
    def of(cls, group_of_row: torch.Tensor) -> RowGroups:
        counts = torch.bincount(group_of_row)
        first_row = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(group_of_row), device=group_of_row.device) - first_row[group_of_row]
        width = int(counts.max())
        return cls(group_of_row, first_row, slot, width, bool((counts == width).all()))


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in a buffer of `capacity` positions; with
    `share_repeats`, rows made by a batch repeat share what their origin row held (module
    docstring). Then `shared_keys`/`shared_values` are [groups, heads, shared length, dim],
    `groups` says which rows share each, and `keys`/`values` hold each row's own part, which
    follows the shared one in the sequence."""

    def __init__(self, capacity: int, share_repeats: bool = False):
        super().__init__()
        self.capacity = capacity
        self.share_repeats = share_repeats
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._clear_shared()

    def _clear_shared(self) -> None:
        self.shared_keys: torch.Tensor | None = None
        self.shared_values: torch.Tensor | None = None
        self.groups: RowGroups | None = None

    @property
    def shared_length(self) -> int:
        return 0 if self.shared_keys is None else self.shared_keys.shape[-2]

    def own_length(self) -> int:
        return super().get_seq_length()

    def get_seq_length(self) -> int:
        return self.shared_length + self.own_length()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.own_length()
        end = length + key_states.shape[-2]
        if not self._fits(end, key_states):
            self._move_to_buffer(length, end, key_states, value_states)
        self._key_buffer[:, :, length:end] = key_states
        self._value_buffer[:, :, length:end] = value_states
        self.keys = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values

    def _fits(self, end: int, key_states: torch.Tensor) -> bool:
        """Whether `keys` is still the front of the buffer (nothing replaced it) with room to
        `end`."""
        buffer = self._key_buffer
        return (
            buffer is not None
            and end <= buffer.shape[-2]
            and self.keys.data_ptr() == buffer.data_ptr()
            and self.keys.shape[0] == buffer.shape[0] == key_states.shape[0]
        )

    def _move_to_buffer(self, length: int, end: int, keys: torch.Tensor, values: torch.Tensor):
        # The planned capacity counts the shared part too; past it (a caller generating more
        # than it said), double.
        planned = self.capacity - self.shared_length
        capacity = max(planned, end) if end <= planned else 2 * end
        shape = (*keys.shape[:2], capacity, keys.shape[-1])
        self._key_buffer = keys.new_empty(shape)
        self._value_buffer = values.new_empty((*shape[:3], values.shape[-1]))
        if length:
            self._key_buffer[:, :, :length] = self.keys
            self._value_buffer[:, :, :length] = self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        if not self.share_repeats or repeats == 1 or self.get_seq_length() == 0:
            super().batch_repeat_interleave(repeats)
            return
        # What each row holds, its group's shared part before it included, becomes the shared
        # part of its `repeats` copies.
        keys, values = self.keys, self.values
        if self.shared_keys is not None:
            group_of_row = self.groups.group_of_row
            keys = torch.cat([self.shared_keys[group_of_row], keys], dim=-2)
            values = torch.cat([self.shared_values[group_of_row], values], dim=-2)
        rows = keys.shape[0]
        self.shared_keys, self.shared_values = keys.contiguous(), values.contiguous()
        self.groups = RowGroups.of(
            torch.arange(rows, device=keys.device).repeat_interleave(repeats)
        )
        self.keys = keys.new_empty((rows * repeats, keys.shape[1], 0, keys.shape[-1]))
        self.values = values.new_empty((rows * repeats, values.shape[1], 0, values.shape[-1]))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.groups is not None:
            # Groups left without rows are let go; the others keep their order.
            kept, group_of_row = torch.unique(
                self.groups.group_of_row[indices], return_inverse=True
            )
            self.groups = RowGroups.of(group_of_row)
            if len(kept) < self.shared_keys.shape[0]:
                self.shared_keys = self.shared_keys[kept]
                self.shared_values = self.shared_values[kept]

    def crop(self, tokens_to_remove: int) -> None:
        if self.shared_keys is not None and -tokens_to_remove > self.own_length():
            raise NotImplementedError("cropping into the keys that rows share")
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        self._clear_shared()
        super().reset()


def preallocated_cache(config: Any, capacity: int, share_repeats: bool = False) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers hold `capacity` positions and,
    with `share_repeats`, keep what repeated rows share once."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity, share_repeats) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache
