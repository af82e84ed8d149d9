"""The ``kfac`` keys that only some stages read, refused where the run's stages would ignore them.

A preset (``kfac.variant``) fills the stage choices a recipe leaves empty. A stage's own settings
(``kfac.options.<name>``, or an older key of its own such as ``kfac.fusion_threshold_mb``) and
``kfac.placement_steps`` take effect only where a stage in use reads them; set and read by none,
they would be silently ignored, so :func:`check` refuses them, naming the key and what reads it.
Only what the user set counts: the older keys at their defaults, the options not given, and
``kfac.placement_steps=0`` say nothing. With ``kfac.variant=sgd`` no ``kfac`` key is read at all
(a recipe may switch K-FAC off and keep its settings); with ``auto``, what any preset it may
choose reads counts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kfacflow import UserError
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.planning.plan import Choice
from kfacflow.kfac.stages import options
from kfacflow.kfac.variants import PRESETS, Stages, resolve
from kfacflow.registry import PLACEMENTS


def check(
    kfac: Any, names: Stages | None = None, where: str = "", prefix: str = "kfac.", intervals: bool = True
) -> None:
    """Check the stages' own settings (:func:`.options.check`), then that the stages in use read them.

    Args:
        kfac: The ``kfac`` section (a ``DictConfig`` or a :class:`~kfacflow.configuration.schema.KFACConfig`).
        names: Its stages (:func:`~kfacflow.kfac.variants.resolve`'s), if known.
        where: What opens a message (the library's ``KFACPreconditioner: ``).
        prefix: What opens a key (``kfac.``; the library's arguments have none).
        intervals: Whether ``kfac.inv_update_freq`` is the run's throughout (the library's may be a schedule).

    Raises:
        UserError: Naming the key, the stages that would read it, and what to set.
    """
    options.check(kfac, f"{where}{prefix}")
    names = names or resolve(kfac)
    if not names.preconditioned:
        return
    if kfac.normalize != "none" and kfac.kl_clip != KFACConfig.kl_clip:
        raise UserError(
            f"{where}{prefix}kl_clip={kfac.kl_clip} is not read with {prefix}normalize={kfac.normalize} (each layer's "
            f"update is scaled on its own instead); leave {prefix}kl_clip out, or set {prefix}normalize=none."
        )
    section = OmegaConf.to_object(kfac) if isinstance(kfac, DictConfig) else kfac
    assert isinstance(section, KFACConfig)
    runs = [resolve(replace(section, variant=preset)) for preset in PRESETS] if names.choose else [names]
    _stage_options(section, runs, where, prefix)
    _placement_steps(section, runs, where, prefix, intervals)


def _chosen(kfac: KFACConfig, runs: list[Stages], kind: str) -> list[str]:
    """The stage of ``kind`` in use in each of ``runs`` (one for each preset ``auto`` may choose)."""
    return [getattr(kfac if kind == "factor" else names, kind) for names in runs]


def _used_as(kfac: KFACConfig, runs: list[Stages], kind: str, prefix: str) -> str:
    chosen = ", ".join(dict.fromkeys(_chosen(kfac, runs, kind)))
    preset = f" ({prefix}variant={kfac.variant})" if not getattr(kfac, kind, None) else ""
    return f"{prefix}{kind} is {chosen} here{preset}"


def _stage_options(kfac: KFACConfig, runs: list[Stages], where: str, prefix: str) -> None:
    defaults = KFACConfig()
    for name, (reg, entry) in options.having().items():
        if name in _chosen(kfac, runs, reg.kind):
            continue
        used = _used_as(kfac, runs, reg.kind, prefix)
        fix = f"set {prefix}{reg.kind}={name} to use it"
        if name in kfac.options:
            raise UserError(
                f"{where}{prefix}options.{name}: {used}, so the {reg.kind} {name!r} and its options are not used; "
                f"{fix}, or remove {prefix}options.{name}."
            )
        kind: type[options.StageOptions] = entry.options  # type: ignore[assignment]  # having(): never None
        for setting, key in kind.KEYS.items():
            value = getattr(kfac, key)
            if value != getattr(defaults, key):
                raise UserError(
                    f"{where}{prefix}{key}={value} sets {prefix}options.{name}.{setting}, but {used}, so it is not "
                    f"used; {fix}, or remove {prefix}{key}."
                )


def _placement_steps(kfac: KFACConfig, runs: list[Stages], where: str, prefix: str, intervals: bool) -> None:
    steps = kfac.placement_steps
    if not steps:
        return
    key = f"{where}{prefix}placement_steps={steps}"
    weighing = [
        names
        for names in runs
        if Choice.named(names).update and getattr(PLACEMENTS.get(names.placement), "weighs_layers", False)
    ]
    if not weighing:
        placed = ", ".join(dict.fromkeys(f"{n.placement}/{n.broadcast}" for n in runs))
        raise UserError(
            f"{key} times the layers to place whole layers by their work, which only {prefix}placement=layer with "
            f"{prefix}broadcast=update or fused_update does; here {prefix}placement/{prefix}broadcast are {placed} "
            f"({prefix}variant={kfac.variant}): set {prefix}placement=layer and {prefix}broadcast=fused_update (as "
            f"{prefix}variant=flow does), or {prefix}placement_steps=0."
        )
    if intervals and kfac.inv_update_freq == 1:
        raise UserError(
            f"{key} places layers by their work between inversions, but {prefix}inv_update_freq=1 inverts every "
            f"step, where the factors are placed for the inversions alone; raise {prefix}inv_update_freq (e.g. 10), "
            f"or set {prefix}placement_steps=0."
        )
