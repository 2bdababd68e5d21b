"""CIFAR-10 in the official python format: find it, download it, read it.

The official archive, ``cifar-10-python.tar.gz`` (https://www.cs.toronto.edu/~kriz/cifar.html),
holds ``cifar-10-batches-py/data_batch_1`` ... ``data_batch_5`` and ``test_batch``:
pickles of ``{b"data": uint8 (N, 3072), b"labels": [N ints], ...}``, each row 1024
red, then 1024 green, then 1024 blue values of a 32x32 image, row by row.

Pickles can run code when loaded, so an archive is unpickled only after its MD5
matches the published one (``MD5``; ``--md5`` for another copy). An extracted
``cifar-10-batches-py/`` directory is trusted as it is (you extracted it).

Downloads go to ``<name>.part`` and are renamed into place only once complete
and checked, so an interrupted run never leaves a file that looks whole. The
next run continues the ``.part`` file with an HTTP ``Range`` request, or starts
over when the server does not support it.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import pickle
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TextIO

import numpy as np

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MD5 = "c58f30108f718f92721af3b95e74349a"
ARCHIVE = "cifar-10-python.tar.gz"
DIRNAME = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
           "truck")
OFFLINE_HINT = (
    "put {archive} (or the extracted {dirname}/) into a directory and pass --data-dir DIR, "
    "or train on generated CIFAR-shaped data with --synthetic"
)


class DataError(Exception):
    """The data set is missing, incomplete or corrupt; the message says what to do."""


class OfflineError(DataError):
    """The download server cannot be reached. ``what`` says so without the advice."""

    def __init__(self, what: str):
        super().__init__(f"{what}; this machine looks offline. "
                         + OFFLINE_HINT.format(archive=ARCHIVE, dirname=DIRNAME))
        self.what = what


class ChecksumError(DataError):
    """A file's MD5 is not the expected one (nothing was unpickled)."""


def default_cache() -> Path:
    """``$FLEET_DATA_HOME/cifar10``, else ``~/.cache/fleet/cifar10``."""
    home = os.environ.get("FLEET_DATA_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fleet")
    return Path(home) / "cifar10"


def md5_of(path: str | os.PathLike) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


#: A download that could not reach the server is remembered in the cache for this
#: many seconds: the runs in between train on generated data at once (a banner says
#: so) instead of waiting for the network again.
RETRY_AFTER = 3600
FAILED_MARK = ".download-failed"


def remember_offline(root: str | os.PathLike, url: str, what: str) -> None:
    """Notes in ``root`` that ``url`` could not be reached now (``what`` says why)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / FAILED_MARK).write_text(f"{int(time.time())} {url}\n{what}\n")  # floor: age >= 0


def recent_offline(root: str | os.PathLike, url: str, within: float = RETRY_AFTER) -> str | None:
    """Why the last download from ``url`` into ``root`` failed, with its age, if it
    failed less than ``within`` seconds ago; else ``None`` (try again)."""
    mark = Path(root) / FAILED_MARK
    try:
        head, what = mark.read_text().split("\n", 2)[:2]
        stamp, was = head.split(" ", 1)
        age = time.time() - float(stamp)
    except (OSError, ValueError):
        return None
    if was != url or not 0 <= age < within:
        return None
    return (f"{what}, {age / 60:.0f} min ago; a run tries again {within / 60:.0f} min after "
            f"that, or at once if you delete {mark}")


def forget_offline(root: str | os.PathLike) -> None:
    (Path(root) / FAILED_MARK).unlink(missing_ok=True)


def locate(data_dir: str | os.PathLike) -> Path | None:
    """The extracted directory or the archive in ``data_dir`` (or ``data_dir`` itself
    when it is the extracted directory); ``None`` when neither is there."""
    data_dir = Path(data_dir)
    for candidate in (data_dir / DIRNAME, data_dir):
        if all((candidate / name).is_file() for name in (*TRAIN_FILES, TEST_FILE)):
            return candidate
    if (data_dir / ARCHIVE).is_file():
        return data_dir / ARCHIVE
    return None


# -- reading -------------------------------------------------------------------------------

def _decode(batch: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        raw, labels = batch[b"data"], batch[b"labels"]
    except (KeyError, TypeError):
        raise DataError(f"{where} is not a CIFAR-10 batch (no b'data' / b'labels')") from None
    raw = np.asarray(raw, np.uint8)
    if raw.ndim != 2 or raw.shape[1] != 3072 or len(raw) != len(labels):
        raise DataError(f"{where}: data {raw.shape} and {len(labels)} labels; expected "
                        "(N, 3072) and N labels")
    images = raw.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # NCHW rows -> NHWC
    return np.ascontiguousarray(images), np.asarray(labels, np.int32)


def _unpickle(f) -> dict:
    return pickle.load(f, encoding="bytes")


def read(path: str | os.PathLike, md5: str | None = MD5) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (images, labels), "test": (images, labels)}``: uint8 NHWC images
    (50000 / 10000 for the real set) and int32 labels.

    Args:
        path: the archive (``.tar.gz``) or the extracted directory.
        md5: the archive's expected MD5, checked before anything is unpickled
            (``None`` skips the check: only for archives you made yourself).
    """
    path = Path(path)
    parts: dict[str, list] = {"train": [], "test": []}
    names = [("train", n) for n in TRAIN_FILES] + [("test", TEST_FILE)]
    if path.is_dir():
        for split, name in names:
            with open(path / name, "rb") as f:
                parts[split].append(_decode(_unpickle(f), str(path / name)))
    else:
        if md5 is not None:
            got = md5_of(path)
            if got != md5:
                raise ChecksumError(
                    f"{path} has MD5 {got}, expected {md5}; it is corrupt or not the official "
                    "archive, so it was not opened. Delete it to download it again, or pass "
                    "--md5 with the MD5 of your own copy"
                )
        with tarfile.open(path, "r:gz") as tar:
            for split, name in names:
                member = f"{DIRNAME}/{name}"
                try:
                    f = tar.extractfile(member)
                except KeyError:
                    f = None
                if f is None:
                    raise DataError(f"{path} has no {member}; is it cifar-10-python.tar.gz?")
                with f:
                    parts[split].append(_decode(_unpickle(f), f"{path}:{member}"))
    return {split: (np.concatenate([p[0] for p in chunks]), np.concatenate([p[1] for p in chunks]))
            for split, chunks in parts.items()}


# -- downloading ---------------------------------------------------------------------------

class _Progress:
    """``cifar-10-python.tar.gz  42%  68.4/162.6 MB  9.1 MB/s``: redrawn on a
    terminal, a line per 10% otherwise."""

    def __init__(self, name: str, total: int | None, done: int, file: TextIO):
        self.name, self.total, self.done, self.file = name, total, done, file
        self.start, self.start_bytes = time.monotonic(), done
        self.last_draw, self.last_decile = 0.0, -1
        self.tty = getattr(file, "isatty", lambda: False)()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.tty and now - self.last_draw < 0.2 and self.done != self.total:
            return
        if not self.tty and self.total:
            decile = int(10 * self.done / self.total)
            if decile == self.last_decile:
                return
            self.last_decile = decile
        self.last_draw = now
        rate = (self.done - self.start_bytes) / max(now - self.start, 1e-9) / 1e6
        if self.total:
            text = (f"{self.name} {100 * self.done / self.total:4.0f}%  "
                    f"{self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB  {rate:.1f} MB/s")
        else:
            text = f"{self.name}  {self.done / 1e6:.1f} MB  {rate:.1f} MB/s"
        self.file.write(("\r" + text) if self.tty else text + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.tty:
            self.file.write("\n")
            self.file.flush()


def _content_range_start(value: str | None) -> int | None:
    """``bytes 100-199/200`` -> 100."""
    try:
        return int(value.split()[1].split("-")[0]) if value else None
    except (IndexError, ValueError):
        return None


def download(url: str, dest: str | os.PathLike, md5: str | None, *, timeout: float = 30,
             attempts: int = 3, file: TextIO | None = None) -> Path:
    """Downloads ``url`` to ``dest``: resumable, checked, atomic.

    Bytes go to ``dest + ".part"``; an interrupted transfer is continued (HTTP
    ``Range``) in the next attempt or the next run, and restarted from zero when
    the server ignores ``Range``. Once complete, the file's MD5 must equal ``md5``
    (a mismatch deletes it), then it is renamed to ``dest``.

    Raises:
        OfflineError: the server cannot be reached (nothing was written).
        ChecksumError: the downloaded bytes have another MD5.
        DataError: the transfer kept failing (run again to resume).
    """
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    out = file if file is not None else sys.stderr
    problem = None
    for _ in range(attempts):
        offset = part.stat().st_size if part.exists() else 0
        request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset
                                         else {})
        try:
            response = urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416 and offset:  # the .part file is not a prefix we can extend
                part.unlink()
                problem = "the server refused to resume (HTTP 416); starting over"
                continue
            raise DataError(f"downloading {url} failed: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise OfflineError(f"cannot reach {url} ({reason})") from None
        with response:
            length = response.headers.get("Content-Length")
            length = int(length) if length is not None else None
            resumed = (offset and response.status == 206
                       and _content_range_start(response.headers.get("Content-Range")) == offset)
            if not resumed:
                offset = 0  # a full response: start the file over
            total = None if length is None else offset + length
            progress = _Progress(dest.name, total, offset, out)
            try:
                with open(part, "ab" if resumed else "wb") as f:
                    while chunk := response.read(1 << 16):
                        f.write(chunk)
                        progress.add(len(chunk))
                    f.flush()
                    os.fsync(f.fileno())
            except (TimeoutError, http.client.HTTPException, OSError) as e:
                problem = f"the transfer broke off ({type(e).__name__}: {e})"
                continue
            finally:
                progress.close()
        size = part.stat().st_size
        if total is not None and size < total:
            problem = f"the transfer broke off at {size} of {total} bytes"
            continue
        break
    else:
        raise DataError(
            f"downloading {url} failed {attempts} times ({problem}); the partial file "
            f"{part} is kept: run again to resume"
        )
    if md5 is not None:
        got = md5_of(part)
        if got != md5:
            part.unlink()
            raise ChecksumError(
                f"the file downloaded from {url} has MD5 {got}, expected {md5}; it was "
                "deleted and not opened. Run again to retry, or use another copy with "
                "--data-dir"
            )
    os.replace(part, dest)
    return dest


# -- generated data ------------------------------------------------------------------------

FAINT = 20.0  # how far a class's pattern lies from the shared one (noise: 120)


def synthetic(n_train: int, n_test: int, seed: int = 1234) -> dict[str, tuple[np.ndarray,
                                                                               np.ndarray]]:
    """CIFAR-shaped data a CNN learns over several epochs, not in one: the classes
    share one coarse colour pattern and differ from it by a faint pattern of their
    own, under heavy noise (same splits as :func:`read`). Generated in chunks of
    float32, so 50000 images need no more memory than the uint8 result and a chunk."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(100, 155, (1, 4, 4, 3)).astype(np.float32)
    patterns = base + rng.uniform(-FAINT, FAINT, (len(CLASSES), 4, 4, 3)).astype(np.float32)
    patterns = patterns.repeat(8, axis=1).repeat(8, axis=2)  # 32x32, in 8x8 blocks
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.integers(0, len(CLASSES), n).astype(np.int32)
        images = np.empty((n, 32, 32, 3), np.uint8)
        for start in range(0, n, 4096):
            chunk = labels[start:start + 4096]
            noise = rng.standard_normal((len(chunk), 32, 32, 3), dtype=np.float32) * 120
            images[start:start + len(chunk)] = np.clip(patterns[chunk] + noise, 0, 255)
        out[split] = (images, labels)
    return out
