"""The small multi-layer perceptron of DETR's box head (and of DAB-DETR's query heads)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class MLP(nn.Module):
    """``num_layers`` Linear layers with ReLU between them (keys ``layers.{i}``)."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int) -> None:
        super().__init__()
        dims = [input_dim] + [hidden_dim] * (num_layers - 1) + [output_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: Tensor) -> Tensor:
        """``(..., input_dim)`` -> ``(..., output_dim)``."""
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x
