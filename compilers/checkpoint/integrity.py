"""What makes a checkpoint trustworthy: one writer for its files, a manifest written
last, a check of it before anything is loaded, and nothing in it run as code.

    write_bytes(path, data)      every checkpoint file goes through it: a full disk or a
                                 file-size limit is an `OSError` naming the file
    save_tensors / load_tensors  weights as safetensors (no pickle at all)
    torch_bytes / load_plain     optimizer, scheduler, RNG state and the rollout
                                 buffer: `torch.save`, read back with
                                 `weights_only=True` (tensors and plain data only; a
                                 crafted pickle is refused, never run)
    write_manifest(folder)       `manifest.json`: size and sha256 of every file of the
                                 folder (DCP shards included), written atomically, last
    checkpoint_damage(folder, s) what is wrong with a checkpoint (None: intact)
    write_failure(exc, where)    a DCP save's failure as the `OSError` it was
    disk_full(exc, last)         the one message for a full disk or a size limit

A checkpoint folder is published (renamed into place) only after its manifest is
written, so a folder without one was not written by this flowgraph, or was changed
after it.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import resource
from pathlib import Path
from typing import Any

import torch

from flowgraph.errors import FlowgraphError
from flowgraph.spelling import option

MANIFEST = "manifest.json"
"""The last file of every checkpoint: `{"files": {relative path: {size, sha256}}}`."""
DISK_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
"""The errnos of a write that found no room: a full disk, a file-size limit
(`ulimit -f`, with SIGXFSZ ignored), a quota."""


def write_bytes(path: Path, data: bytes) -> None:
    """Write and fsync `path`; an `OSError` always names the file (a failed `write` of
    a full disk does not)."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save_tensors(path: Path, state: dict[str, torch.Tensor]) -> None:
    """Weights as safetensors. Tensors sharing storage (tied embeddings) are stored
    once each, as copies: safetensors keeps no aliases."""
    from safetensors.torch import save

    seen: set[int] = set()
    flat: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        tensor = value.detach().to("cpu").contiguous()
        ptr = tensor.untyped_storage().data_ptr()
        flat[name] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    write_bytes(path, save(flat))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise FlowgraphError(f"cannot read the weights `{path}`: {exc}") from None


def load_plain(path: Path, map_location: Any = None) -> Any:
    """A `torch.save` file holding tensors and plain data only; anything else (a class,
    a function: what a crafted file would run) is refused, never unpickled."""
    try:
        return torch.load(path, weights_only=True, map_location=map_location)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FlowgraphError(
            f"refused to load `{path}`: it holds Python objects besides tensors and plain "
            f"data, which loading would run as code ({first}). A checkpoint flowgraph wrote "
            "never does: was the file replaced? Resume from a checkpoint you trust") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise FlowgraphError(f"cannot read `{path}`: {exc}") from None


# --- the manifest --------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: Path) -> None:
    """Size and sha256 of every file in `folder`, written atomically as its last file."""
    files = {name: {"size": (folder / name).stat().st_size, "sha256": _sha256(folder / name)}
             for name in _files(folder)}
    tmp = folder / f"{MANIFEST}.tmp"
    write_bytes(tmp, json.dumps({"files": files}, indent=1, sort_keys=True).encode())
    os.rename(tmp, folder / MANIFEST)


def checkpoint_damage(folder: Path, step: int) -> str | None:
    """What is wrong with the checkpoint of `step` in `folder`, naming the file; None
    when every file is there with the size and sha256 its manifest records, no other,
    and its `state.json` is of `step`."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        listed = {name: (int(want["size"]), str(want["sha256"])) for name, want in files.items()}
    except FileNotFoundError:
        return (f"it has no {MANIFEST} (written before checkpoints had one, or not by "
                "flowgraph)")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return f"its {MANIFEST} is unreadable"
    for name, (size, sha) in listed.items():
        path = folder / name
        if not path.is_file():
            return f"`{name}` is missing"
        actual = path.stat().st_size
        if actual != size:
            how = "empty" if actual == 0 else "truncated" if actual < size else "longer"
            return f"`{name}` is {how}: {actual} bytes, {size} when written"
        if _sha256(path) != sha:
            return f"`{name}` has changed since it was written (its sha256 differs)"
    extra = [name for name in _files(folder) if name not in listed]
    if extra:
        return f"`{extra[0]}` was added after it was written"
    try:
        saved = int(json.loads((folder / "state.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "`state.json` is unreadable"
    return None if saved == step else f"`state.json` says step {saved}, the folder step {step}"


_SHORT_WRITE = ("unexpected pos", "file write failed")
"""How torch's zip writer (under DCP) reports a write that found no room: no errno."""


def write_failure(exc: BaseException, where: Path) -> OSError | None:
    """The full disk (or file-size limit) behind `exc`, a failed DCP save of `where`,
    as an `OSError` naming the file (or `where`); None when it is something else."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.append(e)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
        todo += [f[0] if isinstance(f, tuple) else f
                 for f in getattr(e, "failures", {}).values()]  # DCP: rank -> (error, trace)
    for e in seen:
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return OSError(e.errno, e.strerror, e.filename or str(where))
    if any(text in str(e) for e in seen for text in _SHORT_WRITE):
        limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
        code = errno.EFBIG if limited else errno.ENOSPC
        return OSError(code, os.strerror(code), str(where))
    return None


def disk_full(exc: OSError, last: tuple[int, Path] | None) -> FlowgraphError | None:
    """The one message for a write that found no room (None: `exc` is another error);
    `last`: the newest checkpoint, which a failed write leaves as it was."""
    if exc.errno not in DISK_FULL:
        return None
    what = ("no space left on device (the file-size limit, `ulimit -f`)"
            if exc.errno == errno.EFBIG else "no space left on device")
    where = f"`{exc.filename}`" if exc.filename else "the run's files"
    kept = (f"the last intact checkpoint is step {last[0]} (`{last[1]}`); free some space "
            f"and continue with {option('resume')}" if last else
            "no checkpoint was written yet; free some space and start again")
    return FlowgraphError(f"{what} while writing {where}; {kept}")
