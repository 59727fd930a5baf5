"""CNN: a small convolutional classifier for 1x16x16 images.

Demonstrates Conv2d, BatchNorm2d (batch statistics and running-stat buffer updates in train
mode, running statistics in eval mode), ReLU, MaxPool2d and adaptive average pooling, trained
with cross entropy over 10 classes and SGD with momentum.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from portable.capture.decorator import portable
from portable.optim import SGD

BATCH, NUM_CLASSES = 8, 10


@portable(
    example_inputs=lambda: (torch.randn(BATCH, 1, 16, 16),),
    loss_fn=lambda model, images, labels: F.cross_entropy(model(images), labels),
    example_batch=lambda: (
        torch.randn(BATCH, 1, 16, 16),
        torch.randint(0, NUM_CLASSES, (BATCH,)),
    ),
    optimizer=SGD(lr=1e-2, momentum=0.9),
)
class CNN(nn.Module):
    """Images (B, 1, 16, 16) -> class logits (B, 10)."""

    def __init__(self, num_classes: int = NUM_CLASSES):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 16x16 -> 8x8
            nn.Conv2d(16, 32, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),  # 8x8 -> 1x1
        )
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))
