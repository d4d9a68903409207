"""Where a model runs when no device is named."""

from __future__ import annotations


def default_device(device: str | None) -> str:
    """The device a model loads on: the one given, else CUDA where there is one, else the CPU."""
    if device is not None:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
