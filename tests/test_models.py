"""Tests for kfacflow.models: built-ins, torchvision and timm entries, and name checks."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from kfacflow import UserError
from kfacflow.models import build_model, check_name
from kfacflow.registry import MODELS


def test_import_does_not_load_timm() -> None:
    import subprocess

    code = "import sys, kfacflow.models; assert 'timm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_digits_cnn_forward() -> None:
    model = build_model("digits_cnn", 10, 1)
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 10)
    assert not any(isinstance(m, (nn.BatchNorm2d, nn.Dropout)) for m in model.modules())
    assert all(m.bias is not None for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))


@pytest.mark.parametrize("name, blocks", [("resnet20", 3), ("resnet32", 5)])
def test_cifar_resnets(name: str, blocks: int) -> None:
    model = build_model(name, 10, 3)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) + 1 == 6 * blocks + 2  # 3x3 convs + the fc layer


def test_builtins_build() -> None:
    for name in ("digits_cnn", "resnet20", "resnet32"):
        assert name in MODELS.names()
        assert isinstance(build_model(name, 3, 2), nn.Module)


def test_torchvision_model() -> None:
    model = build_model("resnet18", 7, 3)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(UserError, match="3-channel"):
        build_model("resnet18", 7, 1)


def test_timm_model() -> None:
    model = build_model("timm/resnet18", 4, 1)
    model.eval()
    assert model(torch.randn(1, 1, 32, 32)).shape == (1, 4)


def test_check_name() -> None:
    check_name("digits_cnn")
    check_name("resnet50")
    check_name("timm/resnet18")
    with pytest.raises(UserError, match="model.name.*resnet50"):
        check_name("resnet5O")
    with pytest.raises(UserError, match="model.name.*Did you mean"):
        check_name("timm/resnet1")
    with pytest.raises(UserError, match="model.name"):
        check_name("timm/")
