"""The int8 linear layer of `quantization="int8"` (module `quantization` says why this kernel)."""

from __future__ import annotations

import torch


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights and one bfloat16 scale per output row (symmetric,
    absmax / 127), run by `aten._weight_int8pack_mm` on bfloat16 activations; the result comes
    back in the input's dtype and the bias is added in it."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        amax = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny)
        # The scale as the kernel reads it (bfloat16), so the weights round to that very grid.
        scale = (amax / 127).to(torch.bfloat16)
        rounded = torch.round(weight / scale.float()[:, None]).clamp(-127, 127)
        self.register_buffer("weight_int8", rounded.to(torch.int8).contiguous())
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scale).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights"
