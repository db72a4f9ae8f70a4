"""ResNet-50 (``torchvision.models.resnet50(weights=None)``): random weights, no download.

Input: (batch, 3, 224, 224) float32 images. Output: (batch, 1000) logits. Trainable: ``example_targets`` and
``loss_fn`` (cross-entropy over 1000 classes) are defined for ``--mode train``.
Needs the ``torchvision`` package; without it ``build_model()`` fails with the model-file error naming it.
The 7×7 stem convolution has Cin = 3 (``pad_conv_channels`` pads it to 4 for fp16/bf16 NHWC; measured
in benchmarks/NOTES.md, reference measurements).
"""
import torch

IMAGE_SIZE = 224
NUM_CLASSES = 1000


def build_model() -> torch.nn.Module:
    from torchvision.models import resnet50

    torch.manual_seed(0)
    return resnet50(weights=None, num_classes=NUM_CLASSES)


def example_inputs(batch_size: int):
    return (torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE),)


def example_targets(batch_size: int):
    return torch.randint(0, NUM_CLASSES, (batch_size,))


def loss_fn(output, targets):
    return torch.nn.functional.cross_entropy(output, targets)
