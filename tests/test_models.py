"""Tests for kfacflow.models.builtin: built-ins, torchvision and timm entries, and name checks."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from kfacflow import UserError
from kfacflow.models.builtin import build_model, check_kwargs, check_name
from kfacflow.models.checks import check_input
from kfacflow.registry import MODELS


def test_import_does_not_load_timm() -> None:
    import subprocess

    code = "import sys, kfacflow.models.builtin; assert 'timm' not in sys.modules"
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


# model.kwargs: what the factory does not take is one line naming the argument, before anything is built
# where the factory's parameters say (built-ins, a class timm or torchvision says it returns, the user's
# function), else when it is built (a class whose parameters end in **kwargs).
BAD_KWARGS = [
    pytest.param("digits_cnn", {"depth": 2}, ("model.kwargs.depth", "takes none"), id="builtin"),
    pytest.param(
        "timm/vit_tiny_patch16_224",
        {"img_sz": 32},
        ("model.kwargs.img_sz", "timm's VisionTransformer", "Did you mean 'img_size'", "drop_path_rate"),
        id="timm",
    ),
    pytest.param("resnet18", {"zero_init": True}, ("model.kwargs.zero_init", "zero_init_residual"), id="torchvision"),
    pytest.param("resnet18", {"in_channels": 1}, ("model.kwargs.in_channels", "data's channels"), id="from-data"),
    pytest.param("timm/resnet18", {"pretrained": True}, ("model.kwargs.pretrained", "downloaded"), id="pretrained"),
]
AT_BUILD = [
    pytest.param(
        "timm/regnetx_002", {"nosuch": 1}, ("model.kwargs.nosuch", "RegNetCfg takes: depth"), id="timm-any-kwargs"
    ),
    pytest.param("resnet18", {"layers": [1, 1, 1, 1]}, ("model.kwargs.layers", "sets it itself"), id="set-by-builder"),
    pytest.param(
        "timm/vit_tiny_patch16_224", {"img_size": "abc"}, ("model.kwargs {'img_size': 'abc'}", "TypeError"), id="value"
    ),
]


@pytest.mark.parametrize(("name", "kwargs", "must"), BAD_KWARGS)
def test_a_model_kwarg_the_factory_does_not_take_is_refused_before_building(
    name: str, kwargs: dict[str, object], must: tuple[str, ...]
) -> None:
    with pytest.raises(UserError) as err:
        check_kwargs(name, kwargs)
    for text in must:
        assert text in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "kwargs", "must"), AT_BUILD)
def test_a_model_kwarg_only_the_build_finds_is_one_line(
    name: str, kwargs: dict[str, object], must: tuple[str, ...]
) -> None:
    check_kwargs(name, kwargs)  # its parameters end in **kwargs, or it is a value: only building tells
    with pytest.raises(UserError) as err:
        build_model(name, 10, 3, kwargs)
    for text in must:
        assert text in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


USERS = """
from torch import nn


def net(num_classes, in_channels, width=4):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 64, width), nn.Linear(width, num_classes))


def fixed(num_classes, in_channels):
    return Fixed(num_classes, in_channels)


class Fixed(nn.Module):
    def __init__(self, num_classes, in_channels):
        super().__init__()
        self.fc = nn.Linear(in_channels * 64, num_classes)

    def forward(self, x):
        assert x.shape[-1] == 8, f"this model takes 8 px, not {x.shape[-1]}"
        return self.fc(x.flatten(1))
"""


@pytest.fixture
def users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    (tmp_path / "kfacflow_users_models.py").write_text(USERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "kfacflow_users_models"
    sys.modules.pop("kfacflow_users_models", None)


def test_model_kwargs_reach_the_users_factory(users: str) -> None:
    model = build_model(f"{users}:net", 3, 1, {"width": 7})
    assert isinstance(model, nn.Sequential) and model[1].out_features == 7
    with pytest.raises(UserError, match=r"model.kwargs.widht: .*Did you mean 'width'\? It takes: width\.$"):
        check_kwargs(f"{users}:net", {"widht": 7})


@pytest.mark.slow
def test_model_kwargs_reach_timm_and_torchvision() -> None:
    vit: Any = build_model("timm/vit_tiny_patch16_224", 10, 3, {"img_size": 32, "patch_size": 4, "depth": 1})
    assert vit.patch_embed.img_size == (32, 32) and vit.patch_embed.grid_size == (8, 8) and len(vit.blocks) == 1
    check_input(vit, "timm/vit_tiny_patch16_224", {"img_size": 32}, 3, 32, nhwc=False)
    resnet: Any = build_model("resnet18", 10, 3, {"zero_init_residual": True})
    assert all(int(torch.count_nonzero(block.bn2.weight)) == 0 for block in resnet.layer1)


def test_a_model_that_cannot_take_the_images_is_one_line_whatever_it_raises(users: str) -> None:
    # A plain assert in the model's forward (timm's _assert and torch._assert raise the same).
    model = build_model(f"{users}:fixed", 3, 1)
    with pytest.raises(UserError) as err:
        check_input(model, f"{users}:fixed", {}, 1, 16, nhwc=False)
    line = str(err.value)
    assert "1x16x16 images (data.image_size: 16 px): AssertionError: this model takes 8 px, not 16" in line, line
    assert "Set data.image_size to a size it takes" in line and "\n" not in line, line
    # A convolution that runs out of pixels raises a RuntimeError.
    with pytest.raises(UserError, match=r"model.name=digits_cnn cannot take the data's 1x1x1 images .*RuntimeError"):
        check_input(build_model("digits_cnn", 10, 1), "digits_cnn", {}, 1, 1, nhwc=False)
    check_input(model, f"{users}:fixed", {}, 1, 8, nhwc=True)


def test_the_trial_leaves_the_model_and_the_random_streams_as_they_were() -> None:
    model = build_model("resnet20", 10, 3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    check_input(model, "resnet20", {}, 3, 32, nhwc=False)
    assert model.training and torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_a_timm_vit_at_another_size_names_its_image_size_argument() -> None:
    vit = build_model("timm/vit_tiny_patch16_224", 10, 3, {"depth": 1})
    with pytest.raises(UserError) as err:
        check_input(vit, "timm/vit_tiny_patch16_224", {"depth": 1}, 3, 32, nhwc=False)
    line = str(err.value)
    assert "AssertionError: Input height (32) doesn't match model (224)" in line, line
    assert line.endswith("Build it for 32 px with model.kwargs.img_size=32, or set data.image_size=224."), line
