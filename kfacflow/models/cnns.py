"""The built-in CNNs: a small one for the digits and the CIFAR ResNets (digits_cnn, resnet20, resnet32)."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 digits; no BatchNorm or dropout, so multi-worker runs equal one worker exactly.

    Args:
        num_classes: Outputs of the head.
        in_channels: Input image channels.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        # Keeps the head's input fixed at 32*4*4 whatever data.image_size is.
        self.squeeze = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(N, num_classes)``."""
        x = torch.relu(self.conv1(x))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(self.squeeze(x), 1)
        return self.fc2(torch.relu(self.fc1(x)))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (1x1 conv + BN projection when shapes change).

    Args:
        inp: Input channels.
        out: Output channels.
        stride: Stride of the first convolution (and of the projection).
    """

    def __init__(self, inp: int, out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inp != out:
            self.shortcut = nn.Sequential(nn.Conv2d(inp, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``relu(F(x) + shortcut(x))``."""
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.shortcut(x))


class CifarResNet(nn.Module):
    """CIFAR-style ResNet (He et al. 2016, section 4.2): 3 stages of 16/32/64 channels, ``6n+2`` layers.

    Args:
        n: Basic blocks per stage (3 gives ResNet-20, 5 gives ResNet-32).
        num_classes: Outputs of the head.
        in_channels: Input image channels.
    """

    def __init__(self, n: int, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        inp = 16
        for stage, width in enumerate((16, 32, 64)):
            blocks = []
            for i in range(n):
                blocks.append(BasicBlock(inp, width, stride=2 if stage > 0 and i == 0 else 1))
                inp = width
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(N, num_classes)``."""
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.pool(x), 1))
