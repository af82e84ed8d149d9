"""Models registered in ``registry.MODELS``: built-ins, every torchvision classifier, and ``timm/<name>``."""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from kfacflow import UserError, did_you_mean
from kfacflow.registry import MODELS
from kfacflow.usercode import call_factory

logger = logging.getLogger(__name__)

TIMM_PREFIX = "timm/"


def build_model(name: str, num_classes: int, in_channels: int) -> nn.Module:
    """Build the network registered under ``name``, randomly initialised (never pretrained).

    Args:
        name: A registry name, e.g. ``digits_cnn``, ``resnet50`` or ``timm/resnet18``.
        num_classes: Outputs of the classification head.
        in_channels: Channels of the input images.

    Returns:
        The model, on CPU, in float32.

    Raises:
        UserError: Unknown name, a model that cannot take ``in_channels``, or one with nothing to train.
        UserCodeError: The user's own factory raised (its traceback is printed above the line).
    """
    check_name(name)
    builder = MODELS.get(name)
    if name.startswith(TIMM_PREFIX):
        model = builder(name[len(TIMM_PREFIX) :], num_classes, in_channels)
    elif ":" in name:  # the user's module.path:factory
        model = call_factory(MODELS.key, name, builder, "factory(num_classes, in_channels)", num_classes, in_channels)
    else:
        model = builder(num_classes, in_channels)
    if not isinstance(model, nn.Module):  # a user's factory (module.path:factory) may return anything
        raise UserError(f"model.name={name!r} returned {type(model).__name__}, not a torch.nn.Module.")
    if not any(p.requires_grad for p in model.parameters()):  # the optimizer and DDP would refuse it
        frozen = any(True for _ in model.parameters())
        what = "every parameter is frozen (requires_grad=False)" if frozen else "it has no parameters"
        raise UserError(f"model.name={name!r} has nothing to train: {what}; give it a trainable layer.")
    logger.info("model %s: %d parameters", name, sum(p.numel() for p in model.parameters()))
    return model


def check_name(name: str) -> None:
    """Check that ``model.name`` names a model; cheap unless it starts with ``timm/``.

    Args:
        name: The value of ``model.name``.

    Raises:
        UserError: Unknown name, with close matches.
    """
    if name.startswith(TIMM_PREFIX):
        _check_timm(name[len(TIMM_PREFIX) :])
        return
    if ":" in name:  # the user's own module.path:factory
        MODELS.get(name)
        return
    if name.endswith("/") or name not in MODELS:
        known = [n for n in MODELS.names() if not n.endswith("/")]
        raise UserError(
            f"model.name: unknown model {name!r}.{did_you_mean(name, known)} "
            f"See `python run.py --list model`, or use timm/<name> for a timm model."
        )


def _check_timm(arch: str) -> None:
    if not arch:
        raise UserError("model.name: give a timm model after the prefix, e.g. timm/resnet50.")
    import timm  # imported here: it takes a while and most runs never need it

    if not timm.is_model(arch):
        hint = did_you_mean(arch, timm.list_models())
        raise UserError(f"model.name: timm has no model {arch!r}.{hint} See timm.list_models().")


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


@MODELS.register("digits_cnn", "small CNN for 8x8 digits, no BatchNorm (exact multi-worker equality)")
def _digits_cnn(num_classes: int, in_channels: int) -> nn.Module:
    return DigitsCNN(num_classes, in_channels)


@MODELS.register("resnet20", "CIFAR ResNet-20 (3x3 basic blocks, 16/32/64 channels)")
def _resnet20(num_classes: int, in_channels: int) -> nn.Module:
    return CifarResNet(3, num_classes, in_channels)


@MODELS.register("resnet32", "CIFAR ResNet-32 (5x3 basic blocks, 16/32/64 channels)")
def _resnet32(num_classes: int, in_channels: int) -> nn.Module:
    return CifarResNet(5, num_classes, in_channels)


def _torchvision(name: str, num_classes: int, in_channels: int) -> nn.Module:
    if in_channels != 3:
        raise UserError(
            f"model.name={name!r} is a torchvision model and needs 3-channel images, but the data has "
            f"{in_channels}; pick a 3-channel data.name (e.g. cifar10) or a built-in model."
        )
    import torchvision

    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    assert isinstance(model, nn.Module)
    return model


def _register_torchvision() -> None:
    import torchvision  # 1.5 s of CPU in every process: only where a model is not one of ours

    for name in torchvision.models.list_models(module=torchvision.models):
        MODELS.add(name, functools.partial(_torchvision, name), f"torchvision {name}")


MODELS.defer(_register_torchvision)


@MODELS.register(TIMM_PREFIX, "any timm model as timm/<name>, randomly initialised (e.g. timm/resnet50)")
def _timm(arch: str, num_classes: int, in_channels: int) -> nn.Module:
    import timm

    _check_timm(arch)
    model = timm.create_model(arch, pretrained=False, num_classes=num_classes, in_chans=in_channels)
    assert isinstance(model, nn.Module)
    return model
