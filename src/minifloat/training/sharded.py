"""Checkpoints of multi-process runs: torch.distributed.checkpoint (DCP) in safetensors files, plus one JSON file.

A sharded checkpoint is a directory:

    ckpt/
        shard-0000R-model-00001-of-00001.safetensors   the tensors rank R-1 wrote: model parameters and buffers (FP8
                                                       amax histories and scales included) and optimizer state; DCP
                                                       writes a replicated tensor once, an FSDP2 shard with its offsets
        state.json                                     written by rank 0: format version, world size, the optimizer's
                                                       param_groups, loss scaler, guard, loader position, `extra`
                                                       (step, config, data manifest, schedule, shadow mode)

The tensors go through DCP with `get_state_dict` / `set_state_dict` (keys are module paths, the same for one process,
DDP and FSDP2) and DCP's HuggingFace safetensors storage (`HuggingFaceStorageWriter(save_distributed=True)`), whose
reader rebuilds DCP's metadata from the safetensors headers. Nothing is pickled: no `.metadata` pickle (DCP's
default FileSystemWriter writes one), no torch.load. DCP reshards on load, so a checkpoint written by N ranks loads
on M ranks or in one process, DDP or FSDP2, and vice versa; the RNG state is not kept (the presets draw no random
numbers while training). Block-quantized optimizer states (minifloat.optim) are the exception: their blocks are
formed over each rank's parameter shard, so state.json records their layout (`optimizer_blocks`) and they load only
into the same sharding (same ranks and --parallel); another one is refused before any tensor is read. Writes go to
a temporary sibling directory that rank 0 renames into place once every rank has written, so a job killed mid-save
keeps its previous checkpoint.

    save_sharded(ckpt, model=..., optimizer=..., scaler=..., guard=..., loader=..., extra={...}, world=world)
    load_sharded(ckpt, model=..., optimizer=..., ...)   # any world; one process needs no process group
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minifloat.core.snapshot import restoring_buffers
from minifloat.core.version import __version__
from minifloat.optim.blockwise import BlockwiseOptimizer
from minifloat.core.files import fsync_path, write_json
from minifloat.training.checkpoint import (CHECKPOINT_FIX, MANIFEST_FILE, add_files, check_carried, checkpoint_extra,
                                          move_into_place)
from minifloat.training.jsonstate import CheckpointError, TensorTable, decode, encode, view_key
from minifloat.training.parallel import World, barrier

log = logging.getLogger("minifloat")

FORMAT = "minifloat.sharded"
FORMAT_VERSION = 1
STATE_FILE = "state.json"
_STATEFUL = ("scaler", "guard", "loader")  # objects with plain-data state_dict() / load_state_dict()


def is_sharded(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a sharded (multi-process) checkpoint rather than a single-file one: its state.json,
    or (that lost) its shard files and no single-file manifest, so a damaged one is named as what it is."""
    directory = Path(directory)
    if (directory / STATE_FILE).is_file():
        return True
    return not (directory / MANIFEST_FILE).exists() and any(directory.glob("shard-*.safetensors"))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself; a wrapper subclass (e.g. FSDP2's FP8-gathered weight shard,
    minifloat.distributed.fsdp.Fp8ShardedWeight) as the one plain tensor it wraps."""
    t = t.to_local() if hasattr(t, "to_local") else t
    if not isinstance(t, nn.Parameter) and type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        if len(names) == 1:
            t = getattr(t, names[0])
    return t


def _plain(tree):
    """The state with every tensor as safetensors can write it: a DTensor whose local shard is a wrapper subclass
    (an FP8-gathered weight's shard) rebuilt around the plain tensor it wraps (same values, mesh and placements)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, DTensor) and _local(tree) is not tree.to_local():
        return DTensor.from_local(_local(tree), tree.device_mesh, tree.placements, run_check=False,
                                  shape=tree.shape, stride=tree.stride())
    return tree


def _aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{key: the earlier key it is an exact view of} (tied weights: lm_head.weight -> wte.weight)."""
    first: dict[tuple, str] = {}
    out = {}
    for key, t in state.items():
        view = view_key(_local(t))
        if view is not None and first.setdefault(view[1], key) != key:
            out[key] = first[view[1]]
    return out


def _tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list, dict[str, str]]:
    """(DCP state: model tensors without tied aliases and optimizer state, by module path; the optimizer's
    param_groups; the tied aliases)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # get_state_dict gives a fresh optimizer its state with one zero-lr step; that step must not end an FP8 step
    with restoring_buffers(model):
        model_state, optim_state = get_state_dict(model, optimizer)
    aliases = _aliases(model_state)
    tensors = {"model": {k: v for k, v in model_state.items() if k not in aliases}, "optimizer": optim_state["state"]}
    return tensors, optim_state["param_groups"], aliases


def _block_layout(optimizer: torch.optim.Optimizer) -> list[str | None] | None:
    """BlockwiseOptimizer.block_layout() of the optimizer (or of the one a wrapper steps with), else None."""
    inner = getattr(optimizer, "optimizer", optimizer)  # minifloat.amp.lowp_weights wraps its AdamW
    return inner.block_layout() if isinstance(inner, BlockwiseOptimizer) else None


def _check_block_layout(state: dict, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Refuse to load block-quantized optimizer states into another sharding than the one that wrote them: a block
    holds codes relative to one scale, and the blocks follow the shards (minifloat.optim.blockwise)."""
    saved, here = state.get("optimizer_blocks"), _block_layout(optimizer)
    if saved is None or here is None or len(saved) != len(here):
        return  # no block-wise states, or another model (DCP names the missing keys)
    differ = [(a, b) for a, b in zip(saved, here) if a is not None and b is not None and a != b]
    if differ:
        parallel, ranks = state.get("parallel"), state.get("world_size")
        tp = decode(state["extra"], {}).get("config", {}).get("tp_size", 1) if parallel == "fsdp+tp" else 1
        fix = (f"with --nproc {ranks} --parallel {parallel}" + (f" --tp-size {tp}" if tp > 1 else "") if parallel
               else "in one process or with --parallel ddp")
        raise CheckpointError(f"the checkpoint {directory} holds block-quantized optimizer states laid out for "
                              f"{differ[0][0]}, but this run has {differ[0][1]}: their blocks follow the shards, so "
                              f"codes would meet the wrong block scales; resume it {fix}")


def _json(obj: Any, path: str) -> Any:
    """JSON form of a plain-data state (minifloat.training.jsonstate); tensors do not belong in state.json."""
    table = TensorTable()
    out = encode(obj, path, table)
    if table.tensors:
        raise ValueError(f"{path}: holds tensors ({', '.join(table.tensors)}), which state.json cannot store")
    return out


def save_sharded(directory: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 scaler=None, guard=None, loader=None, extra: Mapping[str, Any] | None = None,
                 files: Mapping[str, bytes] | None = None) -> Path:
    """Write the training state of every rank to `directory` (replacing a checkpoint there); a collective: every
    rank calls it with its own model and optimizer.

    Args:
        directory: the checkpoint directory.
        model: the model (plain, DDP's inner module, or fully_shard-ed).
        optimizer: its torch optimizer.
        world: this run's World (rank 0 writes state.json and moves the directory into place).
        scaler, guard, loader: objects with a plain-data state_dict() (the same on every rank).
        extra: JSON-able metadata (step, config, ...), returned by `load_sharded`.
        files: more files rank 0 writes into the checkpoint, name -> bytes (checkpoint.check_carried).
    Returns:
        The checkpoint directory.
    """
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    directory = Path(directory)
    files = check_carried(files, (STATE_FILE,))
    tmp = directory.parent / f".{directory.name}.tmp-sharded"
    tensors, param_groups, aliases = _tensor_state(model, optimizer)
    state = {"format": FORMAT, "format_version": FORMAT_VERSION, "minifloat_version": __version__,
             "torch_version": torch.__version__, "world_size": world.size,
             "parallel": world.parallel.value if world.parallel else None, "aliases": aliases,
             "optimizer_type": type(optimizer).__qualname__, "param_groups": _json(param_groups, "param_groups"),
             "optimizer_blocks": _block_layout(optimizer),
             **{name: _json(obj.state_dict(), name) if obj is not None else None
                for name, obj in zip(_STATEFUL, (scaler, guard, loader))},
             "extra": _json(dict(extra or {}), "extra")}
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a job killed mid-save
        tmp.mkdir(parents=True)
    barrier(world)
    with warnings.catch_warnings():  # DCP warns that one process saves; that is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save(_plain(tensors), storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True),
             no_dist=not world.distributed)
    barrier(world)  # every rank's shard is on disk
    if world.is_main:
        write_json(tmp / STATE_FILE, state)
        add_files(tmp, files)
        fsync_path(tmp)
        move_into_place(tmp, directory)
        fsync_path(directory.parent)
        log.info("minifloat: saved sharded checkpoint %s (%d ranks)", directory, world.size)
    barrier(world)
    return directory


def _read_state(directory: Path) -> dict:
    path = directory / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; {directory} holds shard files but is not a complete sharded "
                              f"checkpoint; {CHECKPOINT_FIX}")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON (truncated or corrupt): {str(err)[:160]}; {CHECKPOINT_FIX}") \
            from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: not a {FORMAT} checkpoint of format version {FORMAT_VERSION}")
    return state


def read_extra(directory: str | os.PathLike) -> dict[str, Any]:
    """The `extra` metadata of a checkpoint of either kind (sharded, or minifloat.training.checkpoint's)."""
    directory = Path(directory)
    if not is_sharded(directory):
        return checkpoint_extra(directory)
    return decode(_read_state(directory)["extra"], {})


def _first_failure(err: BaseException) -> str:
    """The first rank's failure inside a DCP CheckpointException (its message holds every rank's traceback), or the
    error itself, as one short line."""
    failures = getattr(err, "failures", None)
    inner = next(iter(failures.values())) if isinstance(failures, dict) and failures else err
    if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):  # (exception, its traceback)
        inner = inner[0]
    text = str(inner).strip().splitlines()[-1] if str(inner).strip() else ""
    line = f"{type(inner).__name__}: {text}"
    return line if len(line) <= FAILURE_CHARS else line[:FAILURE_CHARS].rsplit(" ", 1)[0] + " ..."


FAILURE_CHARS = 100  # of the cause quoted in a failed load's one line, cut at a word


class _DcpRootRecords(logging.Filter):
    """Drops what torch.distributed.checkpoint logs to the root logger (its loader's "Global metadata is not found"
    and its traceback): the failed load's CheckpointError says it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "distributed/checkpoint" not in record.pathname.replace("\\", "/")


def load_sharded(directory: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scaler=None, guard=None, loader=None) -> dict[str, Any]:
    """Restore a `save_sharded` checkpoint into this rank's objects, resharding to this run's layout (any number of
    ranks, DDP or FSDP2, or one process without a process group). A collective when torch.distributed is initialised.

    Returns:
        The `extra` metadata saved with the checkpoint.
    Raises:
        CheckpointError: the JSON is corrupt or of another format, the optimizer type or tied weights differ, the
            optimizer's block-quantized states were written under another sharding, or the tensors do not fit the
            model (a key missing, another shape).
    """
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    directory = Path(directory)
    state = _read_state(directory)
    if state.get("optimizer_type") != type(optimizer).__qualname__:
        raise CheckpointError(f"the checkpoint's optimizer is a {state.get('optimizer_type')}, the optimizer given "
                              f"is a {type(optimizer).__qualname__}")
    _check_block_layout(state, optimizer, directory)
    tensors, _, aliases = _tensor_state(model, optimizer)
    if aliases != state["aliases"]:
        raise CheckpointError(f"tied weights differ: {state['aliases']} in the checkpoint, {aliases} in the model")
    dcp_log = logging.getLogger("torch.distributed.checkpoint")
    level, dcp_log.level = dcp_log.level, logging.CRITICAL  # its warnings (with tracebacks) say what the error does
    root_filter = _DcpRootRecords()
    logging.getLogger().addFilter(root_filter)  # some of its modules log to the root logger instead
    try:
        with warnings.catch_warnings():  # DCP warns that one process loads; that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load(tensors, storage_reader=HuggingFaceStorageReader(str(directory)),
                 no_dist=not (torch.distributed.is_available() and torch.distributed.is_initialized()))
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException, every rank's failures in one
        raise CheckpointError(f"the checkpoint {directory} cannot be loaded ({_first_failure(err)}): a shard is "
                              f"missing or damaged, or it is another model's; {CHECKPOINT_FIX}") from None
    finally:
        dcp_log.level = level
        logging.getLogger().removeFilter(root_filter)
    model_state = {**tensors["model"], **{alias: tensors["model"][key] for alias, key in aliases.items()}}
    # the optimizer has its state already (_tensor_state), so this runs no optimizer step and no FP8 step
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict={"state": tensors["optimizer"], "param_groups": decode(state["param_groups"], {})})
    for name, obj in zip(_STATEFUL, (scaler, guard, loader)):
        if obj is not None and state[name] is not None:
            obj.load_state_dict(decode(state[name], {}))
    log.info("minifloat: loaded sharded checkpoint %s (written by %d ranks)", directory, state["world_size"])
    return decode(state["extra"], {})
