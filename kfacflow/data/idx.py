"""The IDX file format of MNIST and Fashion-MNIST (``train-images-idx3-ubyte.gz`` etc.): read and write.

A file is a big-endian header (two zero bytes, a type code, the number of dimensions, each
dimension as a 4-byte integer) followed by the values; the datasets' sites serve them gzipped.
Only unsigned bytes (type code 0x08), the type both datasets use, are read and written.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

UBYTE = 0x08


class IDXError(ValueError):
    """A file that is not an unsigned-byte IDX file (what is wrong is the message)."""


def read(path: Path) -> np.ndarray:
    """Return the uint8 array of an IDX file, gzipped (by its name ending in ``.gz``) or not.

    Raises:
        IDXError: A bad header, a type other than unsigned bytes, or fewer values than the header says.
        OSError: The file cannot be read (also a damaged gzip stream).
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise IDXError("no IDX header (it starts with two zero bytes)")
    if raw[2] != UBYTE:
        raise IDXError(f"type code 0x{raw[2]:02x}; only unsigned bytes (0x08) are read")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise IDXError("the header is cut short")
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    count = int(np.prod(shape)) if shape else 1
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != count:
        raise IDXError(f"{body.size} values where the header says {count} (shape {shape})")
    return body.reshape(shape)


def write(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as IDX, gzipped where ``path`` ends in ``.gz`` (no name or time: reproducible)."""
    values = np.ascontiguousarray(array, dtype=np.uint8)
    head = bytes([0, 0, UBYTE, values.ndim]) + struct.pack(f">{values.ndim}I", *values.shape)
    data = head + values.tobytes()
    if path.name.endswith(".gz"):
        data = gzip.compress(data, compresslevel=9, mtime=0)
    path.write_bytes(data)
