"""The rules the types alone cannot express: every key's range, the run's name, rules across keys."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf

from kfacflow import UserError, did_you_mean
from kfacflow.configuration.errors import merge
from kfacflow.configuration.schema import LAYER_KINDS, KFACConfig, OptimConfig, Range, RunConfig


def check_ranges(node: DictConfig, cls: type, prefix: str = "") -> None:
    """Apply every field's ``metadata["range"]`` of the dataclass ``cls`` (and its sections) to ``node``."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        key, value = f"{prefix}{f.name}", node[f.name]
        if is_dataclass(hints[f.name]):
            check_ranges(value, hints[f.name], f"{key}.")
        elif "range" in f.metadata:
            rule: Range = f.metadata["range"]
            if isinstance(value, ListConfig):
                for i, item in enumerate(value):
                    rule.check(f"{key}[{i}]", item)
            else:
                rule.check(key, value)


def _check_name(name: str) -> None:
    if not name.strip() or name.strip() in (".", "..") or any(c in name for c in "/\\\0"):
        raise UserError(
            f"name={name!r} must be a plain folder name (no '/', '\\', '.' or '..'); out_dir decides where "
            "runs go, e.g. out_dir=runs/study name=trial1."
        )


def reject_empty_resume() -> None:
    """Raise for ``resume=`` given empty (parsed, it reads as no resume: a fresh run where one was to go on).

    Raises:
        UserError: Always, saying what to give.
    """
    raise UserError(
        "resume= is empty; give the run folder a run printed on its last line, e.g. "
        "resume=runs/quickstart/20261129-120000 (leave resume out to start a new run)."
    )


def _check_update_freqs(kfac: DictConfig, lead: str, prefix: str) -> None:
    """Inverses update on factor-update steps only; the message opens with ``lead``, keys carry ``prefix``."""
    if kfac.inv_update_freq % kfac.factor_update_freq:
        raise UserError(
            f"{lead}{prefix}inv_update_freq={kfac.inv_update_freq} must be a multiple of "
            f"{prefix}factor_update_freq={kfac.factor_update_freq}."
        )


OPTIMIZER_KEYS = {"momentum": ("sgd",), "nesterov": ("sgd",), "betas": ("adamw", "muon"), "eps": ("adamw", "muon")}
"""The ``optim`` keys only some of the shipped optimizers read, and which (``muon``: its section ``optim.muon``)."""


def _check_kinds(kinds: Any, key: str) -> None:
    for kind in kinds:
        if kind not in LAYER_KINDS:
            raise UserError(
                f"{key}: {kind!r} is not a kind of layer K-FAC preconditions; name some of "
                f"{', '.join(LAYER_KINDS)}.{did_you_mean(str(kind), list(LAYER_KINDS))}"
            )


def _shown(value: Any) -> Any:
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _check_optimizer_keys(optim: DictConfig) -> None:
    """Refuse a key of ``optim`` the optimizer in use does not read, set away from its default.

    A user's factory gets the whole section and may read any.
    """
    if optim.name not in {name for readers in OPTIMIZER_KEYS.values() for name in readers} | {"muon"}:
        return  # a user's factory reads what it likes; a misspelt name is the registry's to name
    defaults = OmegaConf.structured(OptimConfig)
    keys = [(key, by) for key, by in OPTIMIZER_KEYS.items()] + [(f"muon.{k}", ("muon",)) for k in defaults.muon]
    for key, by in keys:
        value = OmegaConf.select(optim, key)
        if optim.name not in by and value != OmegaConf.select(defaults, key):
            muon = "; Muon's momentum is optim.muon.momentum" if optim.name == "muon" and key == "momentum" else ""
            raise UserError(
                f"optim.{key}={_shown(value)} is read by optim.name={'/'.join(by)} only, not by "
                f"optim.name={optim.name}{muon}; leave optim.{key} out (or at its default, "
                f"{_shown(OmegaConf.select(defaults, key))})."
            )


def check(cfg: DictConfig) -> None:
    """The rules the types alone cannot express: ranges, the run's name, rules across keys.

    Every numeric key is checked against the ``Range`` in its field's metadata. Names of
    registry entries and the files a recipe points at are checked by :func:`kfacflow.running.build.check`.

    Raises:
        UserError: Naming the key to change.
    """
    check_ranges(cfg, RunConfig)
    _check_name(cfg.name)
    if cfg.resume is not None and not cfg.resume.strip():
        reject_empty_resume()
    if len(cfg.optim.betas) != 2:
        raise UserError(
            f"optim.betas takes two numbers in [0, 1), e.g. optim.betas=[0.9,0.999]; got {cfg.optim.betas}."
        )
    if cfg.optim.nesterov and cfg.optim.momentum <= 0:
        raise UserError(
            f"optim.nesterov=true needs optim.momentum > 0 (it is {cfg.optim.momentum}); "
            "set optim.momentum (e.g. 0.9) or optim.nesterov=false."
        )
    _check_optimizer_keys(cfg.optim)
    if cfg.train.amp != "none" and cfg.train.dtype != "float32":
        raise UserError(
            f"train.amp={cfg.train.amp} runs a float32 model's forward pass in half precision; with "
            f"train.dtype={cfg.train.dtype} set train.amp=none (or train.dtype=float32)."
        )
    _check_update_freqs(cfg.kfac, "", "kfac.")
    _check_kinds(cfg.kfac.kinds, "kfac.kinds")


def kfac_section(values: dict[str, Any], where: str) -> KFACConfig:
    """Validate ``kfac`` keys given in code (the library API) as a recipe's are; return the section.

    The stages' own settings and whether the stages in use read them are the caller's to check
    (:func:`kfacflow.kfac.in_use.check`): this module is a leaf the stages import.

    Raises:
        UserError: An unknown key, a wrong type or a value out of range, naming it.
    """
    node = merge(OmegaConf.structured(KFACConfig), values, where)
    check_ranges(node, KFACConfig, "")
    _check_update_freqs(node, f"{where}: ", "")
    _check_kinds(node.kinds, f"{where}: kinds")
    section = OmegaConf.to_object(node)
    assert isinstance(section, KFACConfig)
    return section
