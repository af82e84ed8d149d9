"""Reading a recipe: ``load(recipes, overrides)`` merges YAML files and dotlist overrides over the schema.

A recipe is a path or the name of one that ships in ``kfacflow/recipes/``; ``to_yaml`` writes the
resolved config back (a run folder's ``config.yaml``, which ``resume=`` reads again).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kfacflow import UserError, did_you_mean
from kfacflow.configuration.errors import merge
from kfacflow.configuration.rules import check, reject_empty_resume
from kfacflow.configuration.schema import RunConfig
from kfacflow.configuration.yaml_file import read_yaml

YAML11_BOOLS = ("yes", "no", "on", "off")
"""What YAML 1.1 (and so an override) reads as a bool besides true and false."""
SHIPPED = Path(__file__).resolve().parents[1] / "recipes"
"""The recipes that ship inside the package; a recipe may be named by its file name without ``.yaml``."""


def shipped_recipes() -> list[str]:
    """Return the names of the shipped recipes (``quickstart``, ...)."""
    return sorted(p.stem for p in SHIPPED.glob("*.yaml"))


def find_recipe(path: str) -> str:
    """Return ``path`` if it exists, else the shipped recipe it names (``quickstart``, ``quickstart.yaml``).

    Raises:
        UserError: Neither a file nor a shipped recipe.
    """
    if os.path.exists(path):
        return path
    name = path.removesuffix(".yaml")
    if os.sep not in name and (SHIPPED / f"{name}.yaml").is_file():
        return str(SHIPPED / f"{name}.yaml")
    hint = did_you_mean(name, shipped_recipes()) if os.sep not in name else ""
    if "." in name and all(part.isidentifier() for part in name.split(".")):
        hint += f" An override needs a value: {name}=VALUE."
    raise UserError(
        f"recipe {path!r} does not exist.{hint} Give a YAML file or a shipped recipe: {', '.join(shipped_recipes())}."
    )


def _read_recipe(path: str) -> object:
    where = f"recipe {path!r}"
    path = find_recipe(path)
    data = read_yaml(path, where, "a YAML file such as recipes/quickstart.yaml")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a mapping of keys, not {type(data).__name__}.")
    return data


def load(recipes: list[str], overrides: list[str]) -> DictConfig:
    """Merge recipe files left to right, then ``key.sub=value`` overrides, over the schema.

    A ``resume=<run dir>`` with no recipe starts from that run's saved ``config.yaml``.

    Args:
        recipes: YAML recipe paths.
        overrides: Dotlist overrides (Hydra grammar without the ``+``/``~`` forms).

    Returns:
        The validated config (a structured ``DictConfig`` of :class:`RunConfig`).

    Raises:
        UserError: Unknown key, wrong type, a value out of range, an unreadable recipe, or a
            rule across keys broken (:func:`kfacflow.configuration.rules.check`; registry names are
            :func:`kfacflow.running.build.check`'s).
    """
    cfg = OmegaConf.structured(RunConfig)
    for bad in (o for o in overrides if "=" not in o):
        raise UserError(f"override {bad!r} must look like key.sub=value (e.g. kfac.damping=0.01).")
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            raise UserError(
                f"override {item!r} does not parse ({str(err).splitlines()[0]}); quote YAML's special "
                "characters, e.g. kfac.skip=['*']."
            ) from None
        key, _, text = item.partition("=")
        if key == "resume" and not text.strip():
            reject_empty_resume()  # parsed, it reads as no resume at all: a fresh run where one was to go on
        if text.strip().lower() in YAML11_BOOLS:  # YAML reads them as bools: a bool key takes true or false alone
            raise UserError(
                f"override {item!r}: give true or false for a bool key (YAML reads {text.strip()!r} as a bool), or "
                f"quote the word for text, e.g. {key}=\"'{text.strip()}'\"."
            )
    dot = OmegaConf.from_dotlist(overrides)
    resume = dot.get("resume") if not recipes else None
    if resume:
        saved = Path(str(resume)) / "config.yaml"
        if not saved.is_file():
            raise UserError(f"resume: {resume!r} has no config.yaml; give the run folder printed at the end of a run.")
        cfg = merge(cfg, _read_recipe(str(saved)), str(saved))
    for path in recipes:
        cfg = merge(cfg, _read_recipe(path), path)
    cfg = merge(cfg, dot, "override")
    if not cfg.name:
        cfg.name = Path(recipes[0]).stem if recipes else "run"
    check(cfg)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    """Return the resolved config as YAML (what ``config.yaml`` in a run folder holds)."""
    return OmegaConf.to_yaml(cfg, resolve=True)
