"""Where persisted checkpoints live, and what their files are called.

``persist_path`` is a plain directory or an fsspec URL (``s3://``, ``gs://``,
``memory://``, ``file://``...). The two differ in how a file is put in place -- a directory
gets atomic renames and fsyncs, an object store one PUT per object -- so each is one
:class:`_Tier` implementation (:class:`LocalDir`, :class:`FsspecDir`) and the format code in
:mod:`hotspare.recovery.persist` and :mod:`hotspare.recovery.checkpoint_writer` never asks which one it has.
Torch-free: the agent uses it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

from hotspare.orchestrator.util import atomic_write, fsync_dir

#: a step's directory name: ``step00000040``
STEP_RE = re.compile(r"^step(\d{8})\Z")
MANIFEST = "manifest.json"
_COPY_CHUNK = 64 << 20


class CheckpointError(Exception):
    """A persisted checkpoint is missing, incomplete, truncated or corrupt (the message names the file)."""


def step_name(step: int) -> str:
    return f"step{step:08d}"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / step_name(step)


def rank_file(rank: int) -> str:
    """One rank's safetensors file in a step directory."""
    return f"rank{rank}.safetensors"


def rank_record(rank: int) -> str:
    """One rank's record (size, CRC32, timeline), written once its file is durable."""
    return f"rank{rank}.json"


def join(root: str | Path, *parts: str) -> str:
    """Display/URL form of a path under root (what messages name)."""
    return "/".join([str(root).rstrip("/"), *parts])


def checkpoint_path(root: str | Path, step: int) -> str:
    """Where step's checkpoint lives, as text (a directory or a URL)."""
    return join(root, step_name(step))


def _json_bytes(data: dict) -> bytes:
    return json.dumps(data, indent=1, sort_keys=True).encode()


class _Tier(Protocol):
    """What the checkpoint format needs of the place it is stored in. ``parts`` are names
    under the root (``step00000040``, ``rank0.json``)."""

    #: a plain directory: files can be renamed into place and fsynced
    local: bool

    def read(self, *parts: str) -> bytes:
        """A whole file; FileNotFoundError if absent, OSError for any other failure."""
        ...

    def exists(self, *parts: str) -> bool: ...

    def write_json(self, data: dict, *parts: str) -> None:
        """A small record, all or nothing (a reader never sees half of it)."""
        ...

    def ls(self) -> list[str]:
        """Names directly under the root; none if the root is missing or unreadable."""
        ...

    def rm(self, name: str) -> None:
        """Remove a step directory and everything in it, quietly if already gone."""
        ...

    def put(self, src: Path, *parts: str) -> None:
        """Copy a finished local file into place, durably."""
        ...

    def sync(self, *parts: str) -> None:
        """Make the renames in a directory durable (nothing to do on an object store)."""
        ...


class LocalDir:
    """A directory: the os module, atomic renames, fsync."""

    local = True

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def read(self, *parts: str) -> bytes:
        return self.root.joinpath(*parts).read_bytes()

    def exists(self, *parts: str) -> bool:
        return self.root.joinpath(*parts).exists()

    def write_json(self, data: dict, *parts: str) -> None:
        # 0o666: the umask decides, as for every other file the tier writes
        atomic_write(self.root.joinpath(*parts), _json_bytes(data), mode=0o666)

    def ls(self) -> list[str]:
        try:
            return [p.name for p in self.root.iterdir()]
        except OSError:
            return []

    def rm(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)

    def put(self, src: Path, *parts: str) -> None:
        dst = self.root.joinpath(*parts)
        dst.parent.mkdir(parents=True, exist_ok=True)
        _copy(src, dst)
        fsync_dir(dst.parent)

    def sync(self, *parts: str) -> None:
        fsync_dir(self.root.joinpath(*parts))


class FsspecDir:
    """An fsspec URL: whole-object reads and PUTs (an object's PUT is its atomic write)."""

    local = False

    def __init__(self, url: str) -> None:
        try:
            import fsspec
        except ImportError as e:
            raise CheckpointError(f"{url}: persist_path is a URL, which needs fsspec "
                                  "(pip install fsspec plus the filesystem's package, e.g. s3fs)") from e
        self.fs: Any
        self.fs, self.base = fsspec.core.url_to_fs(url)

    def read(self, *parts: str) -> bytes:
        try:
            return self.fs.cat_file(join(self.base, *parts))
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - each filesystem has its own errors
            raise OSError(str(e)) from e

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(join(self.base, *parts))

    def write_json(self, data: dict, *parts: str) -> None:
        self.fs.pipe_file(join(self.base, *parts), _json_bytes(data))

    def ls(self) -> list[str]:
        try:
            return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.base, detail=False)]
        except (FileNotFoundError, OSError):
            return []

    def rm(self, name: str) -> None:
        try:
            self.fs.rm(join(self.base, name), recursive=True)
        except (FileNotFoundError, OSError):
            pass

    def put(self, src: Path, *parts: str) -> None:
        self.fs.makedirs(join(self.base, *parts[:-1]), exist_ok=True)
        self.fs.put_file(str(src), join(self.base, *parts))

    def sync(self, *parts: str) -> None:
        pass


def tier_for(root: str | Path) -> LocalDir | FsspecDir:
    """The tier ``root`` names: a URL (text with ``://``) is fsspec's, anything else a
    directory. Raises CheckpointError if a URL is given and fsspec is not installed."""
    if isinstance(root, str) and "://" in root:
        return FsspecDir(root)
    return LocalDir(root)


def _copy(src: Path, dst: Path) -> None:
    """Stream ``src`` to ``dst`` (checkpoint files are too big to hold in memory), then
    fsync and rename it into place."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            shutil.copyfileobj(fi, fo, _COPY_CHUNK)
            fo.flush()
            os.fsync(fo.fileno())
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
