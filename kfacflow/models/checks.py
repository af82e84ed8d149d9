"""Whether the model can take the data, and what of it K-FAC leaves to the optimizer alone.

The data: one forward pass of two blank images (or token windows) when the model is built.

Models check their input in their own ways: a convolution that runs out of pixels raises a
``RuntimeError``, a ViT's patch embedding an ``AssertionError`` (timm's ``_assert``, torch's
``torch._assert``, a plain ``assert``). Trying the model once where it is built, before anything
hooks it, finds every kind in the same place and says what to change, in one line.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kfacflow import UserError
from kfacflow.models.builtin import factory_of
from kfacflow.usercode import first_line

logger = logging.getLogger(__name__)

HOOKS = Path(__file__).resolve().parents[1] / "kfac"
"""K-FAC's own code: an error raised there is a bug of kfacflow's, whose traceback is kept."""
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
    if getattr(model, "takes_tokens", False):
        raise UserError(
            f"model.name={name} is a language model: it takes token ids, not the data's {channels}x{size}x{size} "
            "images; give it a text data set (data.name=python_source or text_files), or choose an image model."
        )
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


def check_tokens(model: nn.Module, name: str, kwargs: Mapping[str, Any], vocab: int, seq_len: int) -> None:
    """Run ``model`` once on two windows of ``seq_len`` token ids (eval mode, no gradients), as :func:`check_input`.

    Its logits must be ``(batch, seq_len, vocab)``: one per position, as the loss over every position takes them.

    Raises:
        UserError: The model cannot take the windows, naming ``data.seq_len`` and the model's context argument
            where it has one, or it returns another shape.
    """
    first = next(model.parameters())
    x = torch.zeros(TRIAL, seq_len, dtype=torch.int64, device=first.device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except (AssertionError, RuntimeError, ValueError, IndexError, TypeError) as err:
        takes = "seq_len" in kwargs or "seq_len" in (factory_of(name).takes or ())
        fix = f"set model.kwargs.seq_len={seq_len} or lower data.seq_len" if takes else "lower data.seq_len"
        if not getattr(model, "takes_tokens", False):  # perhaps an image model: token ids are no images
            fix += ", or choose a language model (model.name=gpt)"
        raise UserError(
            f"model.name={name} cannot take the data's windows of {seq_len} tokens (data.seq_len={seq_len}): "
            f"{first_line(err).rstrip('.')}; {fix}."
        ) from None
    finally:
        model.train(training)
    want = (TRIAL, seq_len, vocab)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        raise UserError(
            f"model.name={name} returns {got} for {TRIAL} windows of {seq_len} tokens, not the {want} of a language "
            f"model (a logit per position over the vocabulary of {vocab}); the loss takes every position's."
        )


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


def explained(err: Exception, name: str, data: str, first: bool) -> Exception:
    """The one line an error of a training forward pass stands for, or ``err`` itself (its traceback kept).

    DDP's complaint of a parameter that got no gradient names the key that tells it to look for them;
    an error from inside torch at the first step is about the data's shape (``name``: ``model.name``,
    ``data``: the images and batch size); anything else, or an error raised in K-FAC's hooks, is a bug.
    """
    text = str(err).strip()
    if "find_unused_parameters" in text:
        return UserError(
            "some trained parameter got no gradient at the last step on some rank (a layer that did not run there: "
            "a mixture of experts' expert no token went to, early exit), and DDP was not told to look for them: "
            "set dist.find_unused_parameters=true."
        )
    frames = traceback.extract_tb(err.__traceback__)
    if not first or any(Path(f.filename).resolve().is_relative_to(HOOKS) for f in frames):
        return err
    message = text.splitlines()[0] if text else type(err).__name__
    return UserError(
        f"model.name={name} cannot run on this data ({data}): {message}. Raise data.image_size, or choose a model "
        "made for this input size (e.g. resnet20 for 32 px)."
    )
