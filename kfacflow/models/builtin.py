"""Models registered in ``registry.MODELS``: built-ins, every torchvision classifier, and ``timm/<name>``.

``model.kwargs`` goes to the factory: :func:`check_kwargs` refuses what it does not take wherever its
parameters say so without building anything (the class a timm or torchvision builder returns, a user's
function), else building the model names the argument.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kfacflow import UserError, did_you_mean
from kfacflow.models import gpt
from kfacflow.registry import MODELS
from kfacflow.usercode import call_factory, first_line

logger = logging.getLogger(__name__)

TIMM_PREFIX = "timm/"
FROM_DATA = {"num_classes": "data's classes", "in_chans": "data's channels", "in_channels": "data's channels"}
"""Factory arguments kfacflow gives from the data (``model.kwargs`` may not)."""
DOWNLOADS = ("pretrained", "weights")
"""Factory arguments that would fetch weights: models are built randomly initialised, and nothing is downloaded."""


def build_model(name: str, num_classes: int, in_channels: int, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """Build the network registered under ``name``, randomly initialised (never pretrained).

    Args:
        name: A registry name, e.g. ``digits_cnn``, ``resnet50`` or ``timm/resnet18``.
        num_classes: Outputs of the classification head.
        in_channels: Channels of the input images.
        kwargs: ``model.kwargs``: more keyword arguments of its factory.

    Returns:
        The model, on CPU, in float32.

    Raises:
        UserError: Unknown name, an argument the factory does not take or cannot use, a model that
            cannot take ``in_channels``, or one with nothing to train.
        UserCodeError: The user's own factory raised (its traceback is printed above the line).
    """
    check_name(name)
    kwargs = dict(kwargs or {})
    check_kwargs(name, kwargs)
    builder = MODELS.get(name)
    if name.startswith(TIMM_PREFIX):
        model = builder(name[len(TIMM_PREFIX) :], num_classes, in_channels, **kwargs)
    elif ":" in name:  # the user's module.path:factory
        given = functools.partial(builder, **kwargs) if kwargs else builder
        signature = (
            "factory(num_classes, in_channels, **model.kwargs)" if kwargs else "factory(num_classes, in_channels)"
        )
        model = call_factory(MODELS.key, name, given, signature, num_classes, in_channels)
    else:
        model = builder(num_classes, in_channels, **kwargs)
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


@dataclass(frozen=True)
class Factory:
    """What builds a ``model.name``, and the keyword arguments (``model.kwargs``) it takes."""

    what: str
    """How a message names it, e.g. ``timm's VisionTransformer``."""
    takes: tuple[str, ...] | None
    """Its keyword arguments, in order; ``None``: any that its parameters' ``**kwargs`` passes on (the model's
    build says)."""


def factory_of(name: str) -> Factory:
    """Return what builds the model ``name`` (a checked name) and the arguments it takes, building nothing."""
    entry = _library_entry(name)
    if entry is not None and name.startswith(TIMM_PREFIX):
        import timm

        # timm's own arguments, then its builder's: each entry point hands the rest to the class it returns
        return _of_class("timm", _returned(entry), [*_named(timm.create_model)[1:], *_named(entry)])
    if entry is not None:
        return _of_class("torchvision", _returned(entry), _named(entry))
    if ":" in name:
        return _of_function(name, MODELS.get(name))
    return Factory(f"kfacflow's {name}", tuple(_named(MODELS.get(name), skip=2)))


def _library_entry(name: str) -> Callable[..., Any] | None:
    """The builder timm or torchvision has for the model ``name`` (``None``: not theirs)."""
    if name.startswith(TIMM_PREFIX):
        import timm

        return timm.models.model_entrypoint(timm.models.get_arch_name(name[len(TIMM_PREFIX) :]))  # type: ignore[no-any-return]
    builder = MODELS.get(name)
    if isinstance(builder, functools.partial) and builder.func is _torchvision:
        import torchvision

        return torchvision.models.get_model_builder(name)  # type: ignore[no-any-return]
    return None


def _named(fn: Callable[..., Any], skip: int = 0) -> list[str]:
    """The parameters of ``fn`` a keyword can set, after its first ``skip`` positional ones."""
    params = list(inspect.signature(fn).parameters.values())
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for i, p in enumerate(params) if p.kind in keyword and i >= skip]


def _takes_any(fn: Callable[..., Any]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _returned(entry: Callable[..., Any]) -> type | None:
    """The model class a builder says it returns (its return annotation), if it says."""
    cls = inspect.signature(entry).return_annotation
    return cls if isinstance(cls, type) and issubclass(cls, nn.Module) and cls is not nn.Module else None


def _of_class(library: str, cls: type | None, own: list[str]) -> Factory:
    if cls is None or _takes_any(cls):
        return Factory(f"{library}'s builder", None)
    names = dict.fromkeys([*_named(cls), *own])
    return Factory(f"{library}'s {cls.__name__}", tuple(n for n in names if n not in FROM_DATA and n not in DOWNLOADS))


def _of_function(name: str, fn: Callable[..., Any]) -> Factory:
    what = f"{name.partition(':')[2]}(num_classes, in_channels, ...)"
    try:
        if _takes_any(fn):
            return Factory(what, None)
        return Factory(what, tuple(_named(fn, skip=2)))
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself tells
        return Factory(what, None)


def check_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """Check ``model.kwargs`` against what builds the model ``name`` (a checked name), building nothing.

    Where the factory's parameters end in ``**kwargs`` (a timm or torchvision builder that does not say
    which class it returns, a function of the user's that takes any), building the model names the argument.

    Raises:
        UserError: Naming ``model.kwargs.<arg>`` and what the factory takes.
    """
    for key in kwargs:
        if key in FROM_DATA:
            raise UserError(f"model.kwargs.{key}: kfacflow gives the model the {FROM_DATA[key]}; remove it.")
        if key in DOWNLOADS:
            raise UserError(
                f"model.kwargs.{key}: models are built randomly initialised and nothing is downloaded; remove it."
            )
    factory = factory_of(name) if kwargs else None
    if factory is None or factory.takes is None:
        return
    for key in kwargs:
        if key not in factory.takes:
            takes = (
                f"It takes: {', '.join(factory.takes)}."
                if factory.takes
                else "It takes none: model.kwargs is for gpt, timm/<name>, torchvision and module.path:factory models."
            )
            raise UserError(
                f"model.kwargs.{key}: model.name={name} ({factory.what}) takes no argument {key!r}."
                f"{did_you_mean(key, factory.takes)} {takes}"
            )


UNEXPECTED = re.compile(r"(\w+)(?:\.__init__)?\(\) got an unexpected keyword argument '(\w+)'")
TWICE = re.compile(r"got multiple values for (?:keyword )?argument '(\w+)'")


@contextmanager
def _built_with(name: str, kwargs: Mapping[str, Any]) -> Iterator[None]:
    """What a library's builder raises over ``model.kwargs`` (where :func:`check_kwargs` could not tell): one line."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        if not kwargs:
            raise  # with kfacflow's own arguments alone: a bug, keep the traceback
        unexpected, twice = UNEXPECTED.search(str(err)), TWICE.search(str(err))
        if unexpected and unexpected.group(2) in kwargs:
            arg = unexpected.group(2)
            raise UserError(
                f"model.kwargs.{arg}: model.name={name} takes no argument {arg!r} ({first_line(err)}); remove it."
                f"{_what_takes(name, unexpected.group(1))}"
            ) from None
        if twice and twice.group(1) in kwargs:
            raise UserError(
                f"model.kwargs.{twice.group(1)}: model.name={name} sets it itself ({first_line(err)}); remove it."
            ) from None
        raise UserError(
            f"model.name={name} cannot be built with model.kwargs {dict(kwargs)}: {first_line(err)}; fix model.kwargs."
        ) from None


def _what_takes(name: str, raiser: str) -> str:
    """`` It takes: ...`` of the class or function named ``raiser`` in the module of ``name``'s builder, if found."""
    entry = _library_entry(name)
    found = getattr(sys.modules.get(getattr(entry, "__module__", ""), None), raiser, None)
    try:
        if not callable(found) or _takes_any(found):
            return ""
        takes = [n for n in _named(found) if n not in FROM_DATA and n not in DOWNLOADS and n != "self"]
    except (TypeError, ValueError):  # no signature to read
        return ""
    return f" {raiser} takes: {', '.join(takes)}." if takes else ""


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


MODELS.add("gpt", gpt.build, "GPT-style byte-level language model (text data; model.kwargs n_layer, d_model, ...)")


def _torchvision(name: str, num_classes: int, in_channels: int, **kwargs: Any) -> nn.Module:
    if in_channels != 3:
        raise UserError(
            f"model.name={name!r} is a torchvision model and needs 3-channel images, but the data has "
            f"{in_channels}; pick a 3-channel data.name (e.g. cifar10) or a built-in model."
        )
    import torchvision

    with _built_with(name, kwargs):
        model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
    assert isinstance(model, nn.Module)
    return model


def _register_torchvision() -> None:
    import torchvision  # 1.5 s of CPU in every process: only where a model is not one of ours

    for name in torchvision.models.list_models(module=torchvision.models):
        MODELS.add(name, functools.partial(_torchvision, name), f"torchvision {name}")


MODELS.defer(_register_torchvision)


@MODELS.register(TIMM_PREFIX, "any timm model as timm/<name>, randomly initialised (e.g. timm/resnet50)")
def _timm(arch: str, num_classes: int, in_channels: int, **kwargs: Any) -> nn.Module:
    import timm

    _check_timm(arch)
    with _built_with(f"{TIMM_PREFIX}{arch}", kwargs):
        model = timm.create_model(arch, pretrained=False, num_classes=num_classes, in_chans=in_channels, **kwargs)
    assert isinstance(model, nn.Module)
    return model
