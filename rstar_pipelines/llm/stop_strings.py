"""Stop strings, looked for in the generated text only, as vLLM and OpenAI servers do.

transformers' own `stop_strings` also fires on a stop string that starts inside the prompt (such
as "\\n\\n" after a prompt ending in "\\n"); `GeneratedTextStopCriteria` hands `generate()` the
generated text's search instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tokenizers.decoders import DecodeStream
from transformers import StoppingCriteria


class StopStrings:
    """Whether each row's generated text (not its prompt) contains a stop string yet.

    Each row's tokens are decoded as they come (DecodeStream holds back bytes that do not yet
    make a whole character) and only the new text, with the tail before it that a stop string
    could start in, is searched: constant work per token, where decoding a row's whole text
    each step grows with its length.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], rows: int):
        self._backend = tokenizer.backend_tokenizer
        self._stop = tuple(stop)
        self._overlap = max(len(s) for s in self._stop) - 1
        self._streams = [DecodeStream(skip_special_tokens=False) for _ in range(rows)]
        self._tails = [""] * rows

    def found(self, row: int, tokens: Sequence[int]) -> bool:
        """Whether `tokens`, the next ones `row` generated, complete a stop string."""
        pieces = [self._streams[row].step(self._backend, token) for token in tokens]
        text = self._tails[row] + "".join(piece for piece in pieces if piece)
        self._tails[row] = text[-self._overlap :] if self._overlap else ""
        return any(s in text for s in self._stop)


class GeneratedTextStopCriteria(StoppingCriteria):
    """`StopStrings` as a `generate()` stopping criterion: a row stops for good once found."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], prompt_width: int):
        self._tokenizer, self._stop_strings = tokenizer, stop
        self._decoded_width = prompt_width
        self._stops: StopStrings | None = None
        self._done: list[bool] = []

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        if self._stops is None:
            self._stops = StopStrings(self._tokenizer, self._stop_strings, input_ids.shape[0])
            self._done = [False] * input_ids.shape[0]
        new_tokens = input_ids[:, self._decoded_width :].tolist()
        self._decoded_width = input_ids.shape[1]
        for row, tokens in enumerate(new_tokens):
            self._done[row] = self._done[row] or self._stops.found(row, tokens)
        return torch.tensor(self._done, dtype=torch.bool, device=input_ids.device)
