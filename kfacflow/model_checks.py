"""Whether the model can take the data's images: one forward pass of two blank images when it is built.

Models check their input in their own ways: a convolution that runs out of pixels raises a
``RuntimeError``, a ViT's patch embedding an ``AssertionError`` (timm's ``_assert``, torch's
``torch._assert``, a plain ``assert``). Trying the model once where it is built, before anything
hooks it, finds every kind in the same place and says what to change, in one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kfacflow import UserError
from kfacflow.models import factory_of
from kfacflow.usercode import first_line

TRIAL = 2
"""Images in the trial batch: two, since a BatchNorm without running statistics refuses a batch of one."""
SIZE_ARGS = ("img_size", "image_size", "input_size")
"""Names a model's factory gives the side of the images it is built for (timm's, torchvision's)."""


def check_input(model: nn.Module, name: str, kwargs: Mapping[str, Any], channels: int, size: int, nhwc: bool) -> None:
    """Run ``model`` once on two blank ``channels x size x size`` images (eval mode, no gradients).

    The parameters, buffers and random streams are left as they were: in eval mode nothing draws a
    random number or updates a running statistic, so the run trains as it would without the trial.

    Args:
        model: The model, on its device and in its dtype, not yet hooked or wrapped.
        name: ``model.name``.
        kwargs: ``model.kwargs``.
        channels: The data's channels.
        size: The side of the data's images.
        nhwc: Whether the images come channels-last (``train.channels_last``).

    Raises:
        UserError: The model cannot take them, naming ``data.image_size`` and ``model.kwargs`` where it takes a size.
    """
    first = next(model.parameters())
    x = torch.zeros(TRIAL, channels, size, size, dtype=first.dtype, device=first.device)
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    except (AssertionError, RuntimeError, ValueError) as err:
        raise UserError(
            f"model.name={name} cannot take the data's {channels}x{size}x{size} images (data.image_size: {size} px): "
            f"{first_line(err).rstrip('.')}. {_fix(model, name, kwargs, size)}"
        ) from None
    finally:
        model.train(training)


def _fix(model: nn.Module, name: str, kwargs: Mapping[str, Any], size: int) -> str:
    """What to change: the factory's image-size argument where it has one, else the data or the model."""
    given = [arg for arg in SIZE_ARGS if arg in kwargs]
    takes = factory_of(name).takes or ()
    arg = next(iter(given), None) or next((a for a in SIZE_ARGS if a in takes), None)
    own = None if given else _own_size(model)
    other = f", or set data.image_size={own}" if own and own != size else ""
    if arg:
        return f"Build it for {size} px with model.kwargs.{arg}={size}{other}."
    its = f" ({own} px)" if own else ""
    return f"Set data.image_size to a size it takes{its}, or choose a model made for {size} px images."


def _own_size(model: nn.Module) -> int | None:
    """The side of the images the model was built for, where it says (timm's ``pretrained_cfg``, torchvision's ViT)."""
    cfg = getattr(model, "pretrained_cfg", None)
    shape = cfg.get("input_size") if isinstance(cfg, Mapping) else None
    if isinstance(shape, tuple | list) and shape and isinstance(shape[-1], int):
        return shape[-1]
    side = getattr(model, "image_size", None)
    return side if isinstance(side, int) and not isinstance(side, bool) else None
