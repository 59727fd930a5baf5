"""MLP: the smallest trainable example.

Demonstrates the basic `@portable` contract: a class constructible with no arguments,
`example_inputs` for inference, a regression `loss_fn` (mean squared error) with its
`example_batch`, and SGD with momentum as the optimizer.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from portable.capture.decorator import portable
from portable.optim import SGD

BATCH, IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 32, 64, 4


@portable(
    example_inputs=lambda: (torch.randn(BATCH, IN_FEATURES),),
    loss_fn=lambda model, x, y: F.mse_loss(model(x), y),
    example_batch=lambda: (torch.randn(BATCH, IN_FEATURES), torch.randn(BATCH, OUT_FEATURES)),
    optimizer=SGD(lr=1e-2, momentum=0.9),
)
class MLP(nn.Module):
    """Linear -> GELU -> Linear."""

    def __init__(
        self, in_features: int = IN_FEATURES, hidden: int = HIDDEN, out_features: int = OUT_FEATURES
    ):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))
