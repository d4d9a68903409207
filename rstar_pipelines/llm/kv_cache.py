"""A key/value cache that appends in place, for the transformers backend's generate() calls.

transformers' DynamicLayer appends each step's keys and values with `torch.cat`, which copies the
whole cache every step: for 16 rows over an 800-token context on the embedded model that is
about 1.2 GB moved per generated token, more than the model's weights. `PreallocatedLayer` keeps
them in a buffer sized for the whole call (prompt width + max new tokens, known before the
first step) and hands attention a view of the filled part, so a step writes one token per row.

The layer is a DynamicLayer in every other respect (cropping, batch repeats and selections,
resets): those replace `keys`/`values` with tensors of their own, and the next update moves them
back into a buffer. Only plain full-attention layers are replaced; sliding-window and other
layers keep their own classes.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in a buffer of `capacity` positions."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
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
        # Past the planned capacity (a caller generating more than it said), double.
        capacity = max(self.capacity, end) if end <= self.capacity else 2 * end
        shape = (*keys.shape[:2], capacity, keys.shape[-1])
        self._key_buffer = keys.new_empty(shape)
        self._value_buffer = values.new_empty((*shape[:3], values.shape[-1]))
        if length:
            self._key_buffer[:, :, :length] = self.keys
            self._value_buffer[:, :, :length] = self.values


def preallocated_cache(config: Any, capacity: int) -> DynamicCache:
    """A DynamicCache for `config` whose full-attention layers hold `capacity` positions."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer
        for layer in cache.layers
    ]
    return cache
