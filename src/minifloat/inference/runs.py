"""A training run's folder, for inference and export: its checkpoint, its model as it trained, its calibration data.

    model = load_run("runs/train")                    # the Llama under the run's policy, its FP8 layers included
    batches = run_calibration("runs/train", 8)         # the first 8 validation batches, as its evaluation reads them
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from minifloat.core.rng import restoring_rng
from minifloat.core.validate import check_int
from minifloat.training.checkpoint import MANIFEST_FILE, load_checkpoint
from minifloat.training.config import SETTINGS, TrainConfig, recorded
from minifloat.training.data import load_corpus, val_batches
from minifloat.training.loop import build
from minifloat.training.model import Llama
from minifloat.training.rundir import CHECKPOINT_DIR
from minifloat.training.sharded import is_sharded, load_sharded, read_extra


def run_checkpoint(run: str | os.PathLike, checkpoint: str = "latest") -> Path:
    """The checkpoint folder `checkpoint` names in a run folder: "latest" is RUN/ckpt; another name is a folder
    inside the run, or a path of its own."""
    run = Path(run)
    if run.exists() and not run.is_dir():
        raise FileNotFoundError(f"{run} is a file, not a run folder (the --out of minifloat train)")
    if not run.is_dir():
        raise FileNotFoundError(f"run folder {run} does not exist")
    inside = run / (CHECKPOINT_DIR if checkpoint == "latest" else checkpoint)
    for ckpt in (inside, Path(checkpoint)) if checkpoint != "latest" else (inside,):
        if ckpt.is_dir():
            if (ckpt / "config.json").is_file() and not (ckpt / MANIFEST_FILE).exists():
                raise ValueError(f"{ckpt} is a Hugging Face export (config.json), not a checkpoint of the run; name "
                                 f"a checkpoint folder the run wrote, or read the export with "
                                 f"minifloat.inference.load_hf_export")
            return ckpt
    if (run / "config.json").is_file() and not (run / MANIFEST_FILE).exists():
        raise ValueError(f"{run} is a Hugging Face checkpoint (config.json), not a run folder of minifloat train; "
                         f"load it with transformers' from_pretrained, or an export of minifloat's with "
                         f"minifloat.inference.load_hf_export")
    raise FileNotFoundError(f"{run} has no checkpoint {checkpoint!r} (no folder {inside}); train the run first "
                            f"or name a checkpoint folder")


LOW_PRECISION_RUN = "minifloat_low_precision_run"  # set by load_run: whether the run trained under an FP8/FP4 recipe


def load_run(run: str | os.PathLike, *, checkpoint: str = "latest") -> Llama:
    """A run folder's model as it trained: rebuilt under its precision policy (FP8 layers and their scaling state
    included), on the CPU, in eval mode, with the checkpoint's weights.

    Args:
        run: the run folder (`minifloat train --out`).
        checkpoint: "latest" (the run's ckpt/), or another checkpoint folder (see `run_checkpoint`).
    Raises:
        FileNotFoundError: no such run folder or checkpoint.
        CheckpointError (a ValueError): the checkpoint is corrupt or does not fit its own config.
    """
    ckpt = run_checkpoint(run, checkpoint)
    extra = read_extra(ckpt)
    saved = extra.get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"the checkpoint {ckpt} records no training config; it was not written by minifloat train")
    vocab_size = (extra.get("data") or {}).get("vocab_size", 256)  # the data manifest's; bytes before it was kept
    fields = {k: recorded(k, v) for k, v in saved.items() if k in SETTINGS}
    config = dataclasses.replace(TrainConfig(**fields), nproc=1, parallel=None, resume=False, device="cpu")
    with restoring_rng():  # build seeds torch's generator; loading a model leaves it alone
        # the run's own objects: the checkpoint's keys and dtypes fit
        objects = build(config, torch.device("cpu"), vocab_size=vocab_size)
    if is_sharded(ckpt):  # written by several ranks: DCP reads model and optimizer together
        load_sharded(ckpt, model=objects.model, optimizer=objects.optimizer)
    else:
        load_checkpoint(ckpt, model=objects.model, restore_rng=False)
    setattr(objects.model, LOW_PRECISION_RUN, objects.policy.recipe is not None)
    return objects.model.eval()


def run_calibration(run: str | os.PathLike, batches: int, *, checkpoint: str = "latest") -> list[torch.Tensor]:
    """Calibration inputs for a run's model: the first `batches` (B, T) token batches of its own validation split,
    as its evaluation reads them (the corpus, batch size and sequence length of its checkpoint's config).

    Raises:
        FileNotFoundError: no such run folder or checkpoint, or the run's data folder is gone.
        ValueError: `batches` is not an int >= 1; the run's corpus cannot be read.
    """
    check_int("batches", batches, low=1)
    ckpt = run_checkpoint(run, checkpoint)
    saved = read_extra(ckpt).get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"the checkpoint {ckpt} records no training config; it was not written by minifloat train")
    config = TrainConfig(**{k: v for k, v in saved.items() if k in ("data", "max_bytes", "batch_size", "seq_len")})
    corpus = load_corpus(config.data, max_bytes=config.max_bytes, tokenizer=config.tokenizer)
    return [x for x, _ in val_batches(corpus.val, batch_size=config.batch_size, seq_len=config.seq_len,
                                      max_batches=batches)]
