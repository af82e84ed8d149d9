"""The Vision Transformers a recipe can name: kfacflow's own ``vit`` and timm's through ``model.kwargs``.

What K-FAC must see of them: the patch embedding (a Conv2d) and every Linear, the fused qkv projection
included, as modules its hooks run on; the norms and the position embedding are the optimizer's, and said so.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, run_cli, run_in_gloo
from torch import Tensor, nn

from kfacflow import UserError
from kfacflow.comm.torch_dist import TorchBackend
from kfacflow.configuration.schema import KFACConfig
from kfacflow.kfac.layers import find_layers
from kfacflow.models.builtin import build_model, check_kwargs
from kfacflow.models.checks import check_input
from kfacflow.running import build

RECIPE = ROOT / "recipes" / "fashion_vit.yaml"
TIMM_VIT = "timm/vit_tiny_patch16_224"
TIMM_TINY = {"img_size": 28, "patch_size": 7, "depth": 2, "embed_dim": 32, "num_heads": 2}
"""timm's ViT-Tiny cut to two blocks 32 wide, for Fashion-MNIST's 28 px: the recipe keys of a timm ViT."""


def expected_layers(model: nn.Module, patch: str) -> list[str]:
    """Every Linear of ``model`` and its patch embedding, in the model's order: what K-FAC must precondition."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) or name == patch]


def one_kfac_step(model: nn.Module, backend: TorchBackend, channels: int, size: int) -> Any:
    """One K-FAC step of ``model`` on random images; the preconditioner after it."""
    torch.manual_seed(0)
    pre = build.preconditioner(model, KFACConfig(damping=0.1), backend)
    x, y = torch.randn(8, channels, size, size), torch.randint(0, 10, (8,))
    out = model(x)
    pre.end_forward()
    F.cross_entropy(out, y).backward()
    pre.step(lr=0.1)
    return pre


@pytest.mark.parametrize(("channels", "size", "patch", "tokens"), [(1, 28, 7, 16), (3, 32, 4, 64)])
def test_the_vit_takes_the_datas_images_and_channels(channels: int, size: int, patch: int, tokens: int) -> None:
    model: Any = build_model("vit", 10, channels, {"patch_size": patch}, image_size=size)
    assert model(torch.randn(2, channels, size, size)).shape == (2, 10)
    assert model.patch_embed.in_channels == channels
    assert model.patch_embed.kernel_size == model.patch_embed.stride == (patch, patch)
    assert model.pos_embed.weight.shape == (tokens, 64)
    check_input(model, "vit", {"patch_size": patch}, channels, size, nhwc=False)
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(m.bias is not None and not m.bias.any() for m in linears)
    assert all(0.01 < float(m.weight.detach().std()) < 0.03 for m in linears)  # truncated normal, std 0.02


def test_the_vits_keys_reach_it() -> None:
    kwargs = {"patch_size": 4, "dim": 48, "depth": 2, "heads": 3, "mlp_ratio": 3, "dropout": 0.1}
    check_kwargs("vit", kwargs)
    model: Any = build_model("vit", 10, 1, kwargs, image_size=28)
    assert len(model.blocks) == 2 and model.blocks[0].attn.heads == 3
    assert model.blocks[0].mlp.fc1.out_features == 144 and model.head.in_features == 48
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_k_fac_preconditions_every_linear_and_the_patch_embedding_and_says_what_it_leaves(
    backend: TorchBackend, caplog: pytest.LogCaptureFixture
) -> None:
    model = build_model("vit", 10, 1, {"depth": 2}, image_size=28)
    layers = find_layers(model, [])
    names = [layer.name for layer in layers]
    assert names == expected_layers(model, "patch_embed")
    assert names[:5] == [
        "patch_embed",
        "blocks.0.attn.qkv",
        "blocks.0.attn.proj",
        "blocks.0.mlp.fc1",
        "blocks.0.mlp.fc2",
    ]
    with caplog.at_level(logging.INFO, logger="kfacflow"):
        pre = one_kfac_step(model, backend, 1, 28)
    assert [layer.name for layer in pre.layers] == names  # every hook ran: none dropped after the first step
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "to the optimizer alone" in m] == [
        "K-FAC leaves 11 parameter tensors to the optimizer alone: pos_embed.weight, blocks.*.norm1.weight, "
        "blocks.*.norm1.bias, blocks.*.norm2.weight, blocks.*.norm2.bias, norm.weight, norm.bias; "
        "kfac.kinds may add embedding, norm"
    ]
    # no Linear skipped as it was found, none dropped at the first step for a hook that never ran
    assert [m for m in messages if m.startswith("K-FAC skips") or "to the optimizer: " in m] == []


@pytest.mark.parametrize(
    ("kwargs", "size", "line"),
    [
        pytest.param(
            {"patch_size": 5},
            28,
            "model.kwargs.patch_size=5 does not divide the data's 28 px images (data.image_size): pick a divisor of "
            "28, e.g. 2, 4, 7, 14, or set data.image_size to a multiple of the patch size.",
            id="patch",
        ),
        pytest.param(
            {"dim": 64, "heads": 5},
            28,
            "model.kwargs.heads=5 does not divide model.kwargs.dim=64: pick heads that do, e.g. 1, 2, 4, 8, or another "
            "dim.",
            id="heads",
        ),
    ],
)
def test_a_shape_the_vit_cannot_take_is_one_line_naming_the_key(kwargs: dict[str, int], size: int, line: str) -> None:
    check_kwargs("vit", kwargs)  # only the data's image size tells
    with pytest.raises(UserError) as err:
        build_model("vit", 10, 1, kwargs, image_size=size)
    assert str(err.value) == line


@pytest.mark.slow
def test_a_patch_size_every_worker_refuses_is_one_error_line_from_the_command(tmp_path: Path) -> None:
    # Both workers refuse the model as they build it: rank 0 says so before the launcher stops the job.
    synthetic = ["data.name=synthetic", "data.root=null", "data.image_size=28", "data.channels=1", "data.batch_size=8"]
    proc = run_cli(str(RECIPE), *synthetic, "model.kwargs.patch_size=5", f"out_dir={tmp_path}", "train.progress=false")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: model.kwargs.patch_size=5 does not divide the data's 28 px images (data.image_size): "
        "pick a divisor of 28, e.g. 2, 4, 7, 14, or set data.image_size to a multiple of the patch size."
    ]
    assert "Traceback" not in proc.stderr


def test_the_vits_image_size_is_the_datas() -> None:
    with pytest.raises(UserError, match=r"^model.kwargs.image_size: kfacflow builds model.name=vit for the data's"):
        check_kwargs("vit", {"image_size": 28})
    with pytest.raises(UserError, match=r"^model.kwargs.img_size: .* It takes: patch_size, dim, depth, heads, mlp_"):
        check_kwargs("vit", {"img_size": 28})  # timm's name for it: not a key of this model


def test_timms_vit_through_model_kwargs_is_preconditioned_whole(backend: TorchBackend) -> None:
    check_kwargs(TIMM_VIT, TIMM_TINY)
    model: Any = build_model(TIMM_VIT, 10, 1, TIMM_TINY, image_size=28)
    check_input(model, TIMM_VIT, TIMM_TINY, 1, 28, nhwc=False)
    assert model.patch_embed.grid_size == (4, 4) and len(model.blocks) == 2
    names = [layer.name for layer in find_layers(model, [])]
    assert names == expected_layers(model, "patch_embed.proj")
    assert {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc1", "blocks.0.mlp.fc2", "head"} <= set(names)
    pre = one_kfac_step(model, backend, 1, 28)
    assert [layer.name for layer in pre.layers] == names


def _recipe_steps(rank: int, world: int, out: str) -> dict[str, Any]:
    """The shipped ViT recipe on tiny synthetic data: the model after every step, and the summary."""
    from kfacflow.configuration.recipe import load
    from kfacflow.running.trainer import Trainer

    overrides = [
        f"out_dir={out}",
        "data.name=synthetic",
        "data.root=null",
        "data.image_size=28",
        "data.channels=1",
        "data.num_classes=10",
        "data.train_size=64",
        "data.val_size=16",
        "data.batch_size=8",
        "kfac.factor_update_freq=1",
        "kfac.inv_update_freq=2",
        "train.steps=4",
        "train.progress=false",
        "train.save=false",
    ]
    cfg = load([str(RECIPE)], overrides)
    backend = TorchBackend(cfg.dist)
    try:
        run_dir = Path(out) / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        trainer = Trainer.from_recipe(cfg, backend, run_dir)
        after: list[list[Tensor]] = []
        next_step = trainer._next_step

        def stepped() -> None:
            next_step()
            after.append([t.detach().clone() for t in trainer.model.state_dict().values()])

        trainer._next_step = stepped  # type: ignore[method-assign]
        summary = trainer.fit()
        layers = [layer.name for layer in trainer.kfac.layers] if trainer.kfac is not None else []
        return {"after": after, "summary": summary, "layers": layers, "variant": cfg.kfac.variant}
    finally:
        backend.close()


@pytest.mark.slow
def test_the_recipes_vit_trains_on_two_ranks_with_flow_k_fac_and_every_rank_holds_the_same_model(
    tmp_path: Path,
) -> None:
    ranks = run_in_gloo(_recipe_steps, 2, str(tmp_path), timeout=300)
    assert ranks[0]["variant"] == "flow" and len(ranks[0]["layers"]) == 18  # 4 blocks of 4, the patches, the head
    assert ranks[0]["summary"]["steps"] == 4 and ranks[0]["summary"]["repaired_params"] == 0
    steps = [rank["after"] for rank in ranks]
    assert len(steps[0]) == 4
    for step, (mine, theirs) in enumerate(zip(*steps, strict=True)):
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b), f"the ranks' models differ after step {step + 1}"
    assert any(not torch.equal(a, b) for a, b in zip(steps[0][0], steps[0][-1], strict=True))  # it trained
