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

from torch import nn

from kfacflow import UserError, did_you_mean
from kfacflow.models import gpt
from kfacflow.models.cnns import CifarResNet, DigitsCNN
from kfacflow.models.vit import ViT
from kfacflow.registry import MODELS
from kfacflow.usercode import call_factory, first_line

logger = logging.getLogger(__name__)

TIMM_PREFIX = "timm/"
FROM_DATA = {"num_classes": "data's classes", "in_chans": "data's channels", "in_channels": "data's channels"}
"""Factory arguments kfacflow gives from the data (``model.kwargs`` may not)."""
DOWNLOADS = ("pretrained", "weights")
"""Factory arguments that would fetch weights: models are built randomly initialised, and nothing is downloaded."""
DATA_SIZE = "image_size"
"""The argument by which kfacflow gives its own models (a built-in whose factory takes it) the data's image side."""


def build_model(
    name: str, num_classes: int, in_channels: int, kwargs: Mapping[str, Any] | None = None, image_size: int = 0
) -> nn.Module:
    """Build the network registered under ``name``, randomly initialised (never pretrained).

    Args:
        name: A registry name, e.g. ``digits_cnn``, ``resnet50`` or ``timm/resnet18``.
        num_classes: Outputs of the classification head.
        in_channels: Channels of the input images.
        kwargs: ``model.kwargs``: more keyword arguments of its factory.
        image_size: Side of the data's images, for a built-in that is made for one size (``vit``); 0: its default.

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
        sized = {DATA_SIZE: image_size} if image_size and factory_of(name).sized else {}
        model = builder(num_classes, in_channels, **sized, **kwargs)
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
    sized: bool = False
    """Whether kfacflow gives it the data's image size (:data:`DATA_SIZE`): a built-in made for one size."""


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
    own = _named(MODELS.get(name), skip=2)
    return Factory(f"kfacflow's {name}", tuple(n for n in own if n != DATA_SIZE), sized=DATA_SIZE in own)


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
    if factory is not None and factory.sized and DATA_SIZE in kwargs:
        raise UserError(
            f"model.kwargs.{DATA_SIZE}: kfacflow builds model.name={name} for the data's image size; remove it "
            "(data.image_size resizes the images)."
        )
    if factory is None or factory.takes is None:
        return
    for key in kwargs:
        if key not in factory.takes:
            takes = (
                f"It takes: {', '.join(factory.takes)}."
                if factory.takes
                else "It takes none: model.kwargs is for vit, gpt, timm/<name>, torchvision and module.path:factory."
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


@MODELS.register("digits_cnn", "small CNN for 8x8 digits, no BatchNorm (exact multi-worker equality)")
def _digits_cnn(num_classes: int, in_channels: int) -> nn.Module:
    return DigitsCNN(num_classes, in_channels)


@MODELS.register("resnet20", "CIFAR ResNet-20 (3x3 basic blocks, 16/32/64 channels)")
def _resnet20(num_classes: int, in_channels: int) -> nn.Module:
    return CifarResNet(3, num_classes, in_channels)


@MODELS.register("resnet32", "CIFAR ResNet-32 (5x3 basic blocks, 16/32/64 channels)")
def _resnet32(num_classes: int, in_channels: int) -> nn.Module:
    return CifarResNet(5, num_classes, in_channels)


# The class itself: its parameters are the model.kwargs it takes (patch_size, dim, depth, heads, mlp_ratio, dropout).
MODELS.add("vit", ViT, "small Vision Transformer for the data's image size (patch conv, pre-norm blocks, mean pooling)")
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
