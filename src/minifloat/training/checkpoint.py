"""Checkpoints: the whole training state in safetensors plus a JSON manifest, written atomically, never pickled.

A checkpoint is a directory:

    step_000100/
        tensors.safetensors   every tensor: model parameters and buffers (FP8 amax histories and scales included),
                              optimizer state, the torch RNG states (uint8 tensors)
        manifest.json         format and library versions, the sha256 of tensors.safetensors, each tensor's
                              dtype/shape, and every non-tensor value (optimizer param_groups, loss scaler, guard,
                              loader position, python/numpy RNG, the caller's `extra`)
        tokenizer.json        (a run on token ids) the caller's `files`: the tokenizer the ids were made with

Nothing is pickled, so a checkpoint received from someone else cannot run code when loaded: tensors are raw bytes
in safetensors, everything else is JSON. Non-tensor structure is written as JSON with four tagged forms for what JSON
lacks: {"__tensor__": name} (a tensor in the safetensors file), {"__tuple__": [...]}, {"__float__": "nan"} (and
"inf", "-inf"), {"__items__": [[key, value], ...]} (a dict with non-string keys, e.g. optimizer state by param index).

Tied weights (Llama's lm_head.weight is wte.weight) share storage, which safetensors refuses; a tensor that is an
exact view of one already stored is not stored again, and the manifest maps both state-dict keys to one tensor name.

Writes are atomic: everything goes into a temporary sibling directory, is fsynced, and is renamed into place; an
existing checkpoint at the path is replaced only once the new one is complete. The directory and its files get the
permissions the umask gives new ones (not mkdtemp's 0700). Loads check the manifest's format version, the file's
hash and every key and shape against the objects passed in, and decode everything into memory before any object is
touched: a truncated or mismatched checkpoint raises and changes nothing, with a line that ends with the fix
(CHECKPOINT_FIX: restore a backup, or start the run again).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from minifloat.core.files import apply_umask, fsync_path, remove_abandoned, temp_prefix, write_json
from minifloat.core.rng import rng_state, set_rng_state
from minifloat.core.version import __version__
from minifloat.training.jsonstate import CheckpointError, TensorTable, decode, encode, view_key
from minifloat.training.rundir import CHECKPOINT_DIR as RUN_CHECKPOINT

log = logging.getLogger("minifloat")

FORMAT_VERSION = 1
TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
_HASH_CHUNK = 1 << 20
_STATEFUL = ("scaler", "guard", "loader")  # objects with plain-data state_dict() / load_state_dict()
# The manifest's entries that a load reads: entry -> (its type, whether it may be null: that object was not saved)
_ENTRIES = {**dict.fromkeys(("tensors_file", "tensors", "model", "rng", "extra"), (dict, False)),
            "optimizer_type": (str, True), **dict.fromkeys(("optimizer", *_STATEFUL), (dict, True))}
NAMES_SHOWN = 3  # names (keys, tensors) an error message lists before "and N more"
MALFORMED_DETAIL = 160  # characters of the underlying error a "malformed" message quotes
# what a damaged checkpoint's error line ends with: the state it held is lost unless a copy exists
CHECKPOINT_FIX = ("restore the checkpoint from a backup, or start the run again (minifloat train --overwrite, or "
                  "another --out)")



@contextlib.contextmanager
def _malformed(what: str) -> Iterator[None]:
    """Re-raise what malformed data causes in the block (a list for a dict, no safetensors) as a CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, SafetensorError) as err:
        detail = " ".join(str(err).split())[:MALFORMED_DETAIL]  # the fix after it stays on the printed line
        raise CheckpointError(f"{what} is malformed ({type(err).__name__}: {detail}); {CHECKPOINT_FIX}") from err


def _names(items: list, sep: str = ", ") -> str:
    """The first NAMES_SHOWN items and how many more: a message about 10,000 keys stays one short line."""
    more = f" and {len(items) - NAMES_SHOWN} more" if len(items) > NAMES_SHOWN else ""
    return sep.join(map(str, items[:NAMES_SHOWN])) + more


def _tied_groups(keys_to_names: Mapping[str, str]) -> list[list[str]]:
    """State-dict keys that share one stored tensor, in groups of two or more."""
    groups: dict[str, list[str]] = {}
    for key, name in keys_to_names.items():
        groups.setdefault(name, []).append(key)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def _model_tensor_names(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{key: the first key whose tensor it is an exact view of (itself if none)} for a model's state dict."""
    first: dict[tuple, str] = {}
    names = {}
    for key, t in state.items():
        view = view_key(t)
        names[key] = key if view is None else first.setdefault(view[1], key)
    return names


# ------------------------------------------------------------------------------------------------------ save


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(directory: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scaler=None, guard=None, loader=None, extra: Mapping[str, Any] | None = None,
                    files: Mapping[str, bytes] | None = None, rng: bool = True) -> Path:
    """Write the training state to `directory` (created, or an earlier checkpoint there replaced) atomically.

    Args:
        directory: the checkpoint directory, e.g. "runs/a/step_000100".
        model: its state_dict (parameters and buffers: FP8 scaling state included) is saved.
        optimizer: a torch optimizer (a minifloat.amp wrapper with its inner optimizer's state, compensation buffers
            and generator states); its tensors go to safetensors, everything else to the manifest.
        scaler, guard, loader: a LossScaler, StepGuard and BatchLoader (anything with a plain-data state_dict()).
        extra: JSON-able metadata (step, config, data manifest, ...), returned by `load_checkpoint`.
        files: more files to write into the checkpoint as they are, name -> bytes (`check_carried`).
        rng: save the python, torch and numpy generators' states (a training run's resume needs them; a model saved
            for inference does not, and without them the same model saves to the same bytes).
    Returns:
        The checkpoint directory.
    Raises:
        ValueError: a value cannot be stored without pickle (the message names where it is); a name in `files`
            that is not a new plain file name.
        FileExistsError: `directory` exists and is neither a checkpoint nor empty.
    """
    directory = Path(directory)
    files = check_carried(files, (TENSORS_FILE, MANIFEST_FILE))
    table = TensorTable()
    model_keys = {key: table.add(f"model/{key}", t) for key, t in model.state_dict().items()}
    sections = {
        "optimizer": encode(optimizer.state_dict(), "optim", table) if optimizer is not None else None,
        "optimizer_type": type(optimizer).__qualname__ if optimizer is not None else None,
        **{name: encode(obj.state_dict(), name, table) if obj is not None else None
           for name, obj in zip(_STATEFUL, (scaler, guard, loader))},
        "rng": encode(rng_state() if rng else {}, "rng", table),
        "extra": encode(dict(extra or {}), "extra", table),
    }
    if directory.exists() and not (directory / MANIFEST_FILE).is_file() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not a checkpoint; refusing to replace it")

    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(directory)  # the temporary folders of checkpoints a kill interrupted
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(directory), dir=directory.parent))
    try:
        apply_umask(tmp)  # mkdtemp's 0700 (and safetensors' 0600 below): the permissions the umask gives new ones
        save_file(table.tensors, str(tmp / TENSORS_FILE), metadata={"format": "pt"})
        apply_umask(tmp / TENSORS_FILE)
        fsync_path(tmp / TENSORS_FILE)
        manifest = {
            "format_version": FORMAT_VERSION, "minifloat_version": __version__, "torch_version": torch.__version__,
            "tensors_file": {"name": TENSORS_FILE, "bytes": (tmp / TENSORS_FILE).stat().st_size,
                             "sha256": _sha256(tmp / TENSORS_FILE)},
            "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                        for name, t in table.tensors.items()},
            "model": model_keys,  # state-dict key -> tensor name; tied keys share one name
            **sections,
        }
        write_json(tmp / MANIFEST_FILE, manifest)
        add_files(tmp, files)
        fsync_path(tmp)
        move_into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(directory.parent)
    log.info("minifloat: saved checkpoint %s (%d tensors)", directory, len(table.tensors))
    return directory


def check_carried(files: Mapping[str, bytes] | None, own: tuple[str, ...]) -> dict[str, bytes]:
    """The files a checkpoint carries for its readers (a token run's tokenizer.json), checked before anything is
    written: plain names, none of them one of the checkpoint's `own` files or a .safetensors file.

    Raises:
        ValueError naming the bad name.
    """
    for name in files or {}:
        if Path(name).name != name or name in ("", ".", "..", *own) or name.endswith(".safetensors"):
            raise ValueError(f"a file carried by a checkpoint needs a plain name of its own, got {name!r}")
    return dict(files or {})


def add_files(directory: Path, files: Mapping[str, bytes]) -> None:
    """Write `files` (name -> bytes, from `check_carried`) into a checkpoint directory being written, each synced."""
    for name, data in files.items():
        (directory / name).write_bytes(data)
        fsync_path(directory / name)


def move_into_place(tmp: Path, directory: Path) -> None:
    """Rename the complete `tmp` to `directory`. POSIX rename cannot replace a non-empty directory, so an old
    checkpoint is first renamed aside, and removed only once the new one is in place (restored if that fails)."""
    if not directory.exists():
        os.rename(tmp, directory)
        return
    old = Path(f"{tmp}.old")
    os.rename(directory, old)
    try:
        os.rename(tmp, directory)
    except BaseException:
        os.rename(old, directory)
        raise
    shutil.rmtree(old)


# ------------------------------------------------------------------------------------------------------ load


def _read_manifest(directory: Path) -> dict:
    """The manifest, after checking that it is JSON, of this format version and complete."""
    manifest_path = directory / MANIFEST_FILE
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if (directory / RUN_CHECKPOINT / MANIFEST_FILE).is_file():  # a run's folder named for its checkpoint
            raise CheckpointError(f"{directory} is a run folder, not a checkpoint: its checkpoint is "
                                  f"{directory / RUN_CHECKPOINT}") from None
        if not (directory / TENSORS_FILE).exists():
            raise CheckpointError(f"{directory} is not a checkpoint (it holds no {MANIFEST_FILE}); name a checkpoint "
                                  f"folder, a run's {RUN_CHECKPOINT}/") from None
        raise CheckpointError(f"{manifest_path} is missing; {directory} is not a complete checkpoint; "
                              f"{CHECKPOINT_FIX}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{manifest_path} is not valid JSON (truncated or corrupt): {err}; "
                              f"{CHECKPOINT_FIX}") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{manifest_path}: checkpoint format version {version!r}, but this minifloat reads "
                              f"format version {FORMAT_VERSION}")
    if absent := sorted(_ENTRIES.keys() - manifest.keys()):
        raise CheckpointError(f"{manifest_path} lacks the entries {absent}; {CHECKPOINT_FIX}")
    for entry, (kind, nullable) in _ENTRIES.items():
        if not (isinstance(value := manifest[entry], kind) or nullable and value is None):
            raise CheckpointError(f"{manifest_path} is corrupt: its entry {entry!r} is a {type(value).__name__}, "
                                  f"not a {kind.__name__}; {CHECKPOINT_FIX}")
    return manifest


def _read(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The manifest and the tensors, after checking the manifest, the tensor file's size and hash, and that the
    tensors are the ones the manifest lists."""
    manifest_path, tensors_path = directory / MANIFEST_FILE, directory / TENSORS_FILE
    manifest = _read_manifest(directory)
    expected = manifest["tensors_file"]
    if not tensors_path.is_file():
        raise CheckpointError(f"{tensors_path} is missing; {directory} is not a complete checkpoint; {CHECKPOINT_FIX}")
    size = tensors_path.stat().st_size
    if size != expected["bytes"]:
        raise CheckpointError(f"{tensors_path} is truncated or corrupt: {size} bytes, the manifest says "
                              f"{expected['bytes']}; {CHECKPOINT_FIX}")
    digest = _sha256(tensors_path)
    if digest != expected["sha256"]:
        raise CheckpointError(f"{tensors_path} is corrupt: sha256 {digest}, the manifest says {expected['sha256']}; "
                              f"{CHECKPOINT_FIX}")
    tensors = load_file(str(tensors_path))
    listed = {name: (spec["dtype"], tuple(spec["shape"])) for name, spec in manifest["tensors"].items()}
    found = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items()}
    if listed != found:
        diff = sorted(n for n in listed.keys() | found.keys() if listed.get(n) != found.get(n))
        raise CheckpointError(f"{tensors_path} does not hold the tensors {manifest_path} lists: {_names(diff)}; "
                              f"{CHECKPOINT_FIX}")
    return manifest, tensors


def _check_model(model: nn.Module, manifest: dict, state: Mapping[str, torch.Tensor], directory: Path) -> None:
    """Raise CheckpointError naming the first few missing, unexpected, reshaped, retyped or differently tied keys."""
    own = model.state_dict()
    missing, unexpected = [k for k in own if k not in state], [k for k in state if k not in own]
    differ = [f"{key}: {what} {saved} in the checkpoint, {mine} in the model" for key in own if key in state
              for what, saved, mine in (("shape", tuple(state[key].shape), tuple(own[key].shape)),
                                        ("dtype", state[key].dtype, own[key].dtype)) if saved != mine]
    problems = [f"{what}: {_names(keys)}" for what, keys in (("missing from the checkpoint", missing),
                                                             ("not in the model", unexpected)) if keys]
    problems += [_names(differ, sep="; ")] if differ else []
    saved_ties, own_ties = _tied_groups(manifest["model"]), _tied_groups(_model_tensor_names(own))
    if not missing and not unexpected and saved_ties != own_ties:
        problems.append(f"tied weights differ: {saved_ties} in the checkpoint, {own_ties} in the model")
    if problems:
        raise CheckpointError(f"the checkpoint {directory} ({len(state)} tensors) does not fit the model "
                              f"({len(own)}): " + "; ".join(problems))


def _check_optimizer(optimizer: torch.optim.Optimizer, saved_type: str | None, state: Mapping[str, Any]) -> None:
    own_type = type(optimizer).__qualname__
    if saved_type != own_type:
        raise CheckpointError(f"the checkpoint's optimizer is a {saved_type}, the optimizer given is a {own_type}")
    # a wrapper (minifloat.amp's master-weight optimizers) keeps its inner optimizer's state under "optimizer", and
    # its param_groups are the inner optimizer's
    groups = state["param_groups"] if "param_groups" in state else state["optimizer"]["param_groups"]
    saved = [len(g["params"]) for g in groups]
    own = [len(g["params"]) for g in optimizer.param_groups]
    if saved != own:
        raise CheckpointError(f"the checkpoint's optimizer has parameter groups of sizes {saved}, the optimizer "
                              f"given has {own}")


def checkpoint_extra(directory: str | os.PathLike) -> dict[str, Any]:
    """The `extra` metadata of a checkpoint, read from its manifest alone: the tensor file is neither loaded nor
    hash-checked (a quick look, e.g. at the step and config a run reached; `load_checkpoint` checks everything).

    Raises:
        FileNotFoundError: no such directory.
        CheckpointError: the manifest is missing, corrupt or of another format version, or `extra` holds tensors.
    """
    with _malformed(f"the manifest of {directory}"):
        return decode(_read_manifest(Path(directory))["extra"], {})


def load_checkpoint(directory: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scaler=None, guard=None, loader=None, restore_rng: bool = True) -> dict[str, Any]:
    """Restore a `save_checkpoint` directory into the objects given (those left out are not restored).

    Everything is read, hash-checked, decoded and checked against the objects first; only then are they changed,
    so a checkpoint that fails to load leaves them as they were. torch.load and pickle are never used.

    Args:
        directory: the checkpoint directory.
        model: receives parameters and buffers (strict: keys, shapes, dtypes and weight tying must match).
        optimizer, scaler, guard, loader: restored if given; each must have been saved.
        restore_rng: restore the python, torch (CPU, CUDA) and numpy generators as they were at save time.
    Returns:
        The `extra` metadata saved with the checkpoint.
    Raises:
        FileNotFoundError: no such directory.
        CheckpointError (a ValueError): truncated or corrupt files, another format version, or a checkpoint that
            does not fit the objects (the message names the file or the keys).
    """
    directory = Path(directory)
    given = {"optimizer": optimizer, "scaler": scaler, "guard": guard, "loader": loader}
    with _malformed(f"the checkpoint {directory}"):
        manifest, tensors = _read(directory)
        model_state = {key: tensors[name] for key, name in manifest["model"].items()}
        _check_model(model, manifest, model_state, directory)
        if absent := [name for name, obj in given.items() if obj is not None and manifest[name] is None]:
            raise CheckpointError(f"{directory} holds no {absent[0]} state, but a {absent[0]} was given to restore")
        states = {name: decode(manifest[name], tensors) for name, obj in given.items() if obj is not None}
        if optimizer is not None:
            _check_optimizer(optimizer, manifest["optimizer_type"], states["optimizer"])
        if scaler is not None and scaler.is_enabled() and not states["scaler"]:
            raise CheckpointError(f"{directory} holds a disabled loss scaler's state; the scaler given is enabled")
        rng = (decode(manifest["rng"], tensors) or None) if restore_rng else None  # {}: saved without (rng=False)
        extra = decode(manifest["extra"], tensors)

    # Apply. Generators and small stateful objects validate as they load, so they go first, as (load, saved state,
    # state now) to put back if one (or the optimizer's checks) refuses; the model was checked in full above.
    undo = [(obj.load_state_dict, states[name], copy.deepcopy(obj.state_dict()))
            for name, obj in given.items() if name in _STATEFUL and obj is not None]
    undo += [(set_rng_state, rng, rng_state())] if rng is not None else []
    try:
        with _malformed(f"the saved state in {directory}"):
            for load, saved, _ in undo:
                load(saved)
            if optimizer is not None:
                optimizer.load_state_dict(states["optimizer"])
    except Exception:
        for load, _, now in undo:
            load(now)
        raise
    model.load_state_dict(model_state)
    log.info("minifloat: loaded checkpoint %s", directory)
    return extra
