"""Datasets that ship with tunepod, addressed as ``builtin://<name>`` in a stage step.

``builtin://digits`` is scikit-learn's bundled 8x8 digits (1797 images, no download), split into
train/val/test so the example pipeline runs on a fresh machine without network. The files are
byte-identical for a given seed, so staging them twice copies nothing the second time.

``builtin://python-stdlib`` is a text corpus for the tiny language model example: the sources of a
fixed list of standard library modules, read from the running interpreter's own stdlib folder (no
download), split into train/val/test bytes. Same interpreter, same bytes.
"""

from __future__ import annotations

import io
import json
import sysconfig
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt

from tunepod.errors import TunepodError
from tunepod.runtime.files import write_bytes_atomic

BUILTIN_SCHEME = "builtin://"
DIGITS_SPLITS = {"train": 0.70, "val": 0.15, "test": 0.15}
MANIFEST_FILE = "dataset.json"
# The earliest date a zip entry can carry; any fixed value makes the archive bytes reproducible.
_ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)
_ZIP_CREATE_SYSTEM_UNIX = 3
# Pure-Python modules present in every CPython since 3.8 and not scheduled for removal: a few
# hundred KB of code, comments and docstrings. A fixed list, not a directory listing, so the corpus
# does not change when an interpreter adds or drops unrelated modules.
STDLIB_CORPUS_MODULES = (
    "argparse", "ast", "bisect", "calendar", "contextlib", "copy", "dataclasses", "difflib", "enum",
    "fnmatch", "fractions", "functools", "heapq", "shlex", "statistics", "string", "textwrap", "tokenize",
)  # fmt: skip
# The corpus is cut into blocks dealt out in a fixed pattern of 20: 18 to train, then one to val and
# one to test. Every split then samples every module, and no split is one module's tail.
_TEXT_BLOCK_BYTES = 4096
_TEXT_SPLIT_PATTERN = ("train",) * 18 + ("val", "test")


def write_digits(dest: Path, seed: int = 0) -> list[Path]:
    """Write the digits splits under ``dest`` and return the files written, ``dataset.json`` last.

    ``train.npz``, ``val.npz``, ``test.npz`` hold ``x`` (float32, N x 64, in [0, 1]) and ``y``
    (int64, 0-9), split 70/15/15, stratified by class with ``seed``. Each file is written atomically
    and ``dataset.json`` last, so its presence means the folder is complete. Same seed, same bytes.
    """
    splits = _split_digits(seed)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (x, y) in splits.items():
        path = dest / f"{name}.npz"
        write_bytes_atomic(path, _npz_bytes({"x": x, "y": y}))
        written.append(path)
    manifest = {
        "name": "digits",
        "source": "sklearn.datasets.load_digits",
        "seed": seed,
        "counts": {name: len(y) for name, (_, y) in splits.items()},
        "files": {name: f"{name}.npz" for name in splits},
        "arrays": {"x": "float32, N x 64, pixel / 16 in [0, 1]", "y": "int64 class 0-9"},
    }
    manifest_path = dest / MANIFEST_FILE
    write_bytes_atomic(manifest_path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("ascii"))
    written.append(manifest_path)
    return written


Split = tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]


def _split_digits(seed: int) -> dict[str, Split]:
    # Imported here: scikit-learn takes a second to import and only this function needs it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (np.asarray(digits.data, dtype=np.float32) / np.float32(16.0)).astype(np.float32)
    y = np.asarray(digits.target, dtype=np.int64)
    held_out = DIGITS_SPLITS["val"] + DIGITS_SPLITS["test"]
    x_train, x_rest, y_train, y_rest = train_test_split(
        x, y, test_size=held_out, stratify=y, random_state=seed
    )
    x_val, x_test, y_val, y_test = train_test_split(
        x_rest, y_rest, test_size=DIGITS_SPLITS["test"] / held_out, stratify=y_rest, random_state=seed
    )
    return {"train": (x_train, y_train), "val": (x_val, y_val), "test": (x_test, y_test)}


def _npz_bytes(arrays: Mapping[str, npt.NDArray[np.generic]]) -> bytes:
    """An ``.npz`` archive like ``np.savez`` writes, but with fixed zip metadata (no timestamps)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            entry = zipfile.ZipInfo(f"{name}.npy", date_time=_ZIP_DATE_TIME)
            entry.create_system = _ZIP_CREATE_SYSTEM_UNIX
            entry.external_attr = 0o644 << 16
            payload = io.BytesIO()
            np.lib.format.write_array(payload, np.ascontiguousarray(array), allow_pickle=False)
            archive.writestr(entry, payload.getvalue())
    return buffer.getvalue()


def write_python_stdlib(dest: Path) -> list[Path]:
    """Write the stdlib text splits under ``dest`` and return the files written, ``dataset.json`` last.

    ``train.bin``, ``val.bin``, ``test.bin`` are raw bytes (one token per byte for a byte-level
    model; a block boundary may cut a UTF-8 character): the sources of ``STDLIB_CORPUS_MODULES`` in
    that order, each after a ``# file: NAME.py`` line, dealt out in 4 KiB blocks, 90/5/5. Modules the
    interpreter lacks are skipped and the manifest lists the ones used. Each file is written
    atomically and ``dataset.json`` last. Same interpreter, same bytes.
    """
    corpus, modules = _stdlib_corpus()
    splits: dict[str, bytearray] = {name: bytearray() for name in ("train", "val", "test")}
    for index, start in enumerate(range(0, len(corpus), _TEXT_BLOCK_BYTES)):
        split = _TEXT_SPLIT_PATTERN[index % len(_TEXT_SPLIT_PATTERN)]
        splits[split] += corpus[start : start + _TEXT_BLOCK_BYTES]
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in splits.items():
        path = dest / f"{name}.bin"
        write_bytes_atomic(path, bytes(data))
        written.append(path)
    manifest = {
        "name": "python-stdlib",
        "source": f"standard library sources of Python {sysconfig.get_python_version()}",
        "modules": modules,
        "counts": {name: len(data) for name, data in splits.items()},
        "files": {name: f"{name}.bin" for name in splits},
        "format": "raw bytes, one token per byte (vocabulary 256)",
    }
    manifest_path = dest / MANIFEST_FILE
    write_bytes_atomic(manifest_path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("ascii"))
    written.append(manifest_path)
    return written


def _stdlib_corpus() -> tuple[bytes, list[str]]:
    """The concatenated sources of the corpus modules this interpreter has, and their names."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, used = [], []
    for module in STDLIB_CORPUS_MODULES:
        source = stdlib / f"{module}.py"
        if source.is_file():
            parts.append(f"# file: {module}.py\n".encode("ascii") + source.read_bytes())
            used.append(module)
    return b"\n".join(parts), used


BUILTIN_SOURCES: dict[str, Callable[[Path], list[Path]]] = {
    "digits": write_digits,
    "python-stdlib": write_python_stdlib,
}
"""Every builtin dataset: name -> function that writes it into a folder and returns its files."""


def materialize_builtin(uri: str, cache_dir: Path) -> Path:
    """The folder ``<cache_dir>/<name>`` holding ``builtin://<name>``, written on first use.

    A folder whose ``dataset.json`` exists is complete (it is written last) and is reused as is.
    Raises ``TunepodError`` for another scheme or an unknown name, listing the valid builtins.
    """
    valid = ", ".join(f"{BUILTIN_SCHEME}{name}" for name in sorted(BUILTIN_SOURCES))
    if not uri.startswith(BUILTIN_SCHEME):
        raise TunepodError(f"{uri!r} is not a builtin dataset URI; valid: {valid}")
    name = uri[len(BUILTIN_SCHEME) :].strip("/")
    if name not in BUILTIN_SOURCES:
        raise TunepodError(f"unknown builtin dataset {uri!r}; valid: {valid}")
    folder = cache_dir / name
    if not (folder / MANIFEST_FILE).is_file():
        BUILTIN_SOURCES[name](folder)
    return folder
