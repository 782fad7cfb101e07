"""The small multi-layer perceptron of DETR's box head (and of DAB-DETR's query heads)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

# The activations an MLP may put between its layers.
MLP_ACTIVATIONS = {"relu": F.relu, "silu": F.silu}


class MLP(nn.Module):
    """``num_layers`` Linear layers with an activation between them (keys ``layers.{i}``):
    ReLU, or ``activation="silu"`` (DEIM's heads)."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int,
                 activation: str = "relu") -> None:
        super().__init__()
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(MLP_ACTIVATIONS)}, "
                             f"got {activation!r}")
        dims = [input_dim] + [hidden_dim] * (num_layers - 1) + [output_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.activation = activation
        self._act = MLP_ACTIVATIONS[activation]

    def forward(self, x: Tensor) -> Tensor:
        """``(..., input_dim)`` -> ``(..., output_dim)``."""
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self._act(x)
        return x
