"""The SimpleCNN of the seed article (seeds/000): conv 3→32 3×3 pad 1, ReLU, max-pool 2, linear 8192→10.

Input: (batch, 3, 32, 32) float32 images. Output: (batch, 10) logits.
On the H200 this model trains *slower* with AMP than in FP32 (504k vs 742k samples/s at batch 1024;
benchmarks/NOTES.md, reference measurements), so the tuner must be able to answer "keep FP32".
"""
import torch
import torch.nn as nn


class SimpleCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(kernel_size=2)
        self.fc = nn.Linear(32 * 16 * 16, 10)

    def forward(self, x):
        x = self.pool(self.act(self.conv1(x)))
        x = x.flatten(1)
        return self.fc(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return SimpleCNN()


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 3, 32, 32),)


def example_targets(batch_size: int):
    return torch.randint(0, 10, (batch_size,))


def loss_fn(output, targets):
    return nn.functional.cross_entropy(output, targets)
