"""The language model: text corpora as bytes (python_source, text_files), the GPT, the loss and perplexity over
every position, stopping at a loss, and a 2-worker run of recipes/charlm_gpt.yaml."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, last_line, run_cli, run_cli_batch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from kfacflow import UserError
from kfacflow.configuration.schema import DataConfig
from kfacflow.data.checks import DataInfo, check_sets, cross_entropy
from kfacflow.data.sets import build_datasets, check_data
from kfacflow.data.text import SEPARATOR, Windows, split_of, stdlib_files, stdlib_root
from kfacflow.models.builtin import build_model, check_kwargs
from kfacflow.models.checks import check_input, check_tokens
from kfacflow.models.gpt import GPT
from kfacflow.running.evaluation import evaluate, perplexity
from kfacflow.running.precision import MixedPrecision
from kfacflow.running.records import RunRecords, target_line

RECIPE = str(ROOT / "recipes" / "charlm_gpt.yaml")
TINY = {"n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 8}


def write_corpus(root: Path, n: int = 30) -> dict[str, bytes]:
    """``n`` small text files in two folders, a hidden one the corpus leaves out."""
    files = {f"{'a' if i % 2 else 'b'}/f{i:02d}.txt": f"file {i}: {'xyz' * i}\n".encode() for i in range(n)}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text)
    (root / ".hidden").write_bytes(b"not text of the corpus")
    return files


def test_the_split_is_by_path_and_the_checksums_are_stable(tmp_path: Path) -> None:
    files = write_corpus(tmp_path)
    cfg = DataConfig(name="text_files", root=str(tmp_path), seq_len=8, text_bytes=0)
    train, val, info = build_datasets(cfg)
    assert info == DataInfo(num_classes=256, seq_len=8) and info.tokens
    assert info.identity is not None and build_datasets(cfg)[2].identity == info.identity
    # The corpus is every file in sorted path order, on the side its path's hash puts it, each ended by a NUL.
    sides = {side: b"".join(files[f] + SEPARATOR for f in sorted(files) if split_of(f) == side) for side in (0, 1)}
    assert sides[1] and sides[0]
    ident = info.identity
    assert ident["bytes"] == {"train": len(sides[0]), "val": len(sides[1])}
    assert ident["sha256"] == {side: hashlib.sha256(sides[i]).hexdigest() for i, side in enumerate(("train", "val"))}
    assert ident["sha256"]["train"].startswith("3d4c1fe3")  # the same bytes on every machine
    assert ident["files"] == {"train": 28, "val": 2} and len(train) == (len(sides[0]) - 1) // 8  # type: ignore[arg-type]
    # A file keeps its side whatever else is in the folder.
    (tmp_path / sorted(files)[0]).unlink()
    again = build_datasets(cfg)[2].identity
    assert again is not None and again["sha256"]["val"] == ident["sha256"]["val"]
    # data.text_bytes takes nine tenths from the training files and a tenth from the validation files.
    capped = build_datasets(DataConfig(name="text_files", root=str(tmp_path), seq_len=8, text_bytes=200))[2].identity
    assert capped is not None and capped["bytes"] == {"train": 180, "val": 20}
    assert len(val) == (len(sides[1]) - 1) // 8  # type: ignore[arg-type]


def test_one_file_gives_its_last_tenth_to_validation(tmp_path: Path) -> None:
    (tmp_path / "only.txt").write_bytes(bytes(range(200)) * 5)
    _, _, info = build_datasets(DataConfig(name="text_files", root=str(tmp_path), seq_len=4, text_bytes=0))
    assert info.identity is not None and info.identity["bytes"] == {"train": 901, "val": 100}  # 1000 bytes and a NUL


def test_windows_are_inputs_and_their_targets_one_byte_on() -> None:
    windows = Windows(b"abcdefghij", 3)
    assert len(windows) == 3  # the last window's target needs the byte after it
    x, y = windows[1]
    assert x.dtype == y.dtype == torch.int64
    assert bytes(x.tolist()) == b"def" and bytes(y.tolist()) == b"efg"
    assert bytes(windows[2][1].tolist()) == b"hij"
    with pytest.raises(IndexError):
        windows[3]


def test_python_source_reads_the_standard_librarys_own_files() -> None:
    root = stdlib_root()
    found = stdlib_files(root)
    assert "os.py" in found and "json/decoder.py" in found
    parts = {part for path in found for part in path.split("/")[:-1]}
    assert not parts & {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    assert found == sorted(found) and all(path.endswith(".py") for path in found)
    train, val, info = build_datasets(DataConfig(name="python_source", text_bytes=20_000, seq_len=16))
    assert info.identity is not None and info.identity["python"] and info.identity["bytes"]["train"] == 18_000
    x, y = train[0]  # type: ignore[index]
    assert bytes(x.tolist()) == (root / found[0]).read_bytes()[:16] and torch.equal(x[1:], y[:-1])
    assert len(val) == 2_000 // 16 - (2_000 % 16 == 0)  # type: ignore[arg-type]


def tiny_gpt(**kwargs: object) -> GPT:
    torch.manual_seed(0)
    model = build_model("gpt", 256, 1, {**TINY, **kwargs})
    assert isinstance(model, GPT)
    return model


def test_gpt_gives_a_logit_per_position_and_sees_only_the_past() -> None:
    model = tiny_gpt().eval()
    x = torch.randint(0, 256, (2, 8))
    out = model(x)
    assert out.shape == (2, 8, 256)
    changed = x.clone()
    changed[:, 5] = (changed[:, 5] + 1) % 256
    again = model(changed)
    assert torch.equal(out[:, :5], again[:, :5])  # what comes later changes nothing before it
    assert not torch.allclose(out[:, 5:], again[:, 5:])
    assert len(model(x[:, :3])[0]) == 3  # a shorter context than the longest


def test_the_tied_head_is_the_embeddings_parameter() -> None:
    tied, untied = tiny_gpt(), tiny_gpt(tie=False, norm="rms")
    assert tied.head.weight is tied.tok.weight
    assert sum(p is tied.tok.weight for p in tied.parameters()) == 1  # once, for the optimizer and DDP
    assert untied.head.weight is not untied.tok.weight
    assert isinstance(untied.norm, nn.RMSNorm) and isinstance(tied.norm, nn.LayerNorm)


def test_the_loss_is_over_every_position() -> None:
    logits, targets = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    flat = F.cross_entropy(logits.reshape(15, 7), targets.reshape(15))
    assert torch.allclose(cross_entropy(logits, targets, "text"), flat)
    assert torch.allclose(cross_entropy(logits, targets, "text", reduction="sum"), 15 * flat)


class Uniform(nn.Module):
    """Equal logits over a vocabulary of 4: every token's loss is ln 4."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(*x.shape, 4)


def test_evaluation_reports_perplexity_exp_of_the_loss_per_token() -> None:
    x = torch.zeros(3, 6, dtype=torch.int64)
    y = torch.tensor([[0, 1, 2, 3, 0, 0]] * 3)  # argmax is 0: half the tokens right
    backend = SimpleNamespace(device=torch.device("cpu"), allreduce_sum=lambda t: t)
    loader = DataLoader(TensorDataset(x, y), batch_size=2)
    precision = MixedPrecision("none", torch.device("cpu"), 1.0)
    args = (backend, precision, "text", torch.preserve_format, torch.float32)
    with torch.no_grad():  # as the trainer evaluates
        record = evaluate({"": Uniform()}, loader, *args, tokens=True)  # type: ignore[arg-type]
        plain = evaluate({"": Uniform()}, loader, *args)  # type: ignore[arg-type]
    assert record["val_loss"] == pytest.approx(math.log(4)) and record["val_acc"] == pytest.approx(0.5)
    assert record["val_ppl"] == pytest.approx(4.0) and perplexity(1e4) == math.inf
    assert "val_ppl" not in plain and plain["val_loss"] == record["val_loss"]


def test_a_run_stops_at_a_validation_loss() -> None:
    train = SimpleNamespace(stop_at_accuracy=0.0, stop_at_loss=1.5, timing_warmup=0)
    records = RunRecords(train, torch.device("cpu"))
    records.history = [
        {"step": s, "epoch": s / 10, "seconds": float(s), "val_loss": loss, "val_acc": 0.5}
        for s, loss in ((10, 2.0), (20, 1.5), (30, 1.2))
    ]
    assert records.reached is records.history[1]
    hit = {"loss_target": 1.5, "val_loss": 1.5, "step": 20, "epoch": 2.0, "seconds": 20.0}
    assert records.when(records.history[1]) == hit
    summary = {"target_reached": records.when(records.history[1]), "stopped_at_accuracy": None, "stopped_at_loss": 1.5}
    assert target_line({**summary, "steps": 20}, 40) == "train.stop_at_loss=1.5 reached: stopped at step 20 of 40"
    both = RunRecords(SimpleNamespace(stop_at_accuracy=0.6, stop_at_loss=1.5, timing_warmup=0), torch.device("cpu"))
    both.history = records.history
    assert both.reached is None  # every target set, not one of them


def test_models_and_data_that_do_not_fit_say_so_in_one_line() -> None:
    gpt = tiny_gpt()
    with pytest.raises(UserError, match=r"data.seq_len=16\): .*model.kwargs.seq_len=16 or lower data.seq_len"):
        check_tokens(gpt, "gpt", TINY, 256, 16)
    with pytest.raises(
        UserError, match=r"^model.name=digits_cnn cannot .*, or choose a language model \(model.name=gpt\)\.$"
    ):
        check_tokens(build_model("digits_cnn", 256, 1), "digits_cnn", {}, 256, 8)
    with pytest.raises(UserError, match="is a language model: it takes token ids"):
        check_input(gpt, "gpt", {}, 1, 8, False)
    with pytest.raises(UserError, match=r"returns shape \(2, 8, 10\) for 2 windows of 8 tokens"):
        check_tokens(nn.Sequential(nn.Embedding(256, 10)), "embedding", {}, 16, 8)
    with pytest.raises(UserError, match="model.kwargs.d_model=15 must split evenly"):
        build_model("gpt", 256, 1, {"d_model": 15, "n_head": 2})
    with pytest.raises(UserError, match="model.kwargs.n_layers: .* Did you mean 'n_layer'"):
        check_kwargs("gpt", {"n_layers": 2})
    tokens = DataInfo(num_classes=4, seq_len=3)
    with pytest.raises(UserError, match=r"the inputs of sample 0 are torch.float32 tensor of shape \(3,\)"):
        check_sets("mine", [(torch.zeros(3), torch.zeros(3, dtype=torch.int64))], [], tokens)
    with pytest.raises(UserError, match="the targets of sample 0 hold token ids from 5 to 7, outside the vocabulary"):
        check_sets("mine", [(torch.arange(3), torch.arange(3) + 5)], [], tokens)
    with pytest.raises(UserError, match=r"^data.augment=true: data.name=python_source is text, .*set it to false"):
        check_data(DataConfig(name="python_source", augment=True))
    with pytest.raises(UserError, match=r"^data.image_size=32 is the side of images"):
        check_data(DataConfig(name="python_source", image_size=32))


def test_a_recipes_mistakes_with_text_end_in_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    common = ["launch.nproc=1", "data.text_bytes=40000", "data.batch_size=4", f"out_dir={tmp_path}"]
    runs = [
        [RECIPE, *common, "data.augment=true"],
        [RECIPE, *common, "data.seq_len=256"],
        [RECIPE, *common, "data.name=text_files", f"data.root={tmp_path / 'empty'}"],
        [RECIPE, *common, "data.name=digits"],
    ]
    says = [
        "data.augment=true: data.name=python_source is text",
        "model.name=gpt cannot take the data's windows of 256 tokens (data.seq_len=256)",
        "holds no file",
        "model.name=gpt is a language model",
    ]
    for proc, said in zip(run_cli_batch(runs), says, strict=True):
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and said in errors[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_the_recipe_trains_a_language_model_on_two_workers(tmp_path: Path) -> None:
    model = [f"model.kwargs.{k}={v}" for k, v in {**TINY, "seq_len": 16}.items()]
    proc = run_cli(
        RECIPE,
        *model,
        "data.text_bytes=40000",
        "data.seq_len=16",
        "data.batch_size=8",
        "train.steps=6",
        "train.eval_every_steps=3",
        "train.metrics=jsonl",
        "train.progress=false",
        f"out_dir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = Path(last_line(proc))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6 and len(summary["history"]) == 2
    assert summary["val_loss"] < math.log(256) and summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]))
    assert all(row["val_ppl"] == pytest.approx(math.exp(row["val_loss"])) for row in summary["history"])
    data = json.loads((run_dir / "data.json").read_text())
    assert data["name"] == "python_source" and data["bytes"] == {"train": 36_000, "val": 4_000}
    assert len(data["sha256"]["train"]) == 64
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["ppl"] for row in rows if row["kind"] == "val"] == [h["val_ppl"] for h in summary["history"]]
    assert "val_ppl" in proc.stderr and "corpus python_source" in proc.stderr
