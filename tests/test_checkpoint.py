"""Tests for minifloat.training.checkpoint: bitwise resume of an FP8 Llama, tied weights, corrupt and mismatched
checkpoints (which must change nothing), atomic saves, and loading without pickle.

One module-scoped run trains a tiny FP8 Llama (DelayedScaling, AdamW with two parameter groups, an enabled
LossScaler whose scale grows during the run, a StepGuard, a BatchLoader), saves a checkpoint and trains on; the
tests load that checkpoint into fresh objects. Each step masks random targets with the global torch RNG, so the
resumed losses depend on the RNG state being restored too.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import random
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import minifloat as mf
import minifloat.training.checkpoint as ckpt
from minifloat.training.checkpoint import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    TENSORS_FILE,
    CheckpointError,
    checkpoint_extra,
    load_checkpoint,
    save_checkpoint,
)
from minifloat.training.data import BatchLoader
from minifloat.safety.guards import GuardConfig, StepGuard
from minifloat.training.model import Llama, LlamaConfig

SEED = 0
OTHER_SEED = 1  # fresh objects start from other weights, so a load that restored nothing would show
BATCH, SEQ_LEN = 2, 16
STEPS_BEFORE, STEPS_AFTER = 3, 3
MASK_PROB = 0.1  # fraction of targets masked with the global RNG each step
# growth_interval 2 makes the loss scale grow during the run, so the scaler's trackers matter on resume
SCALER_GROWTH_INTERVAL = 2
EXTRA = {"step": STEPS_BEFORE, "config": {"preset": "tiny", "lr": 1e-3}}
MESSAGE_LIMIT = 400  # characters the command line prints of an error (minifloat.cli.MESSAGE_LIMIT)


@dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: mf.LossScaler
    guard: StepGuard
    loader: BatchLoader


def corpus() -> torch.Tensor:
    return torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED))


def fp8_llama(seed: int, recipe=None, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return mf.convert(Llama(LlamaConfig.preset("tiny", **overrides)), recipe=recipe or mf.DelayedScaling())


def make_run(seed: int) -> Run:
    model = fp8_llama(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3)
    scaler = mf.LossScaler(enabled=True, growth_interval=SCALER_GROWTH_INTERVAL, model=model)
    guard = StepGuard(model, optimizer, config=GuardConfig(spike_signals=("loss",)))
    return Run(model, optimizer, scaler, guard, BatchLoader(corpus(), batch_size=BATCH, seq_len=SEQ_LEN, seed=SEED))


def train(run: Run, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        run.guard.begin_step(step, data_position=run.loader.position)
        x, y = next(run.loader)
        y = y.masked_fill(torch.rand(y.shape) < MASK_PROB, -1)
        _, loss = run.model(x, y)
        run.scaler.scale(loss).backward()
        assert not run.guard.check(loss).skipped
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert not unequal, f"differ: {unequal}"


@dataclass
class Saved:
    path: Path
    state_at_save: dict[str, torch.Tensor]
    stateful_at_save: dict[str, dict]
    losses_after: list[float]
    state_after: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Saved:
    run = make_run(SEED)
    train(run, STEPS_BEFORE)
    path = save_checkpoint(tmp_path_factory.mktemp("run") / "step_000003", model=run.model, optimizer=run.optimizer,
                           scaler=run.scaler, guard=run.guard, loader=run.loader, extra=EXTRA)
    at_save = clone_state(run.model)
    stateful = {"scaler": run.scaler.state_dict(), "guard": run.guard.state_dict(), "loader": run.loader.state_dict()}
    losses = train(run, STEPS_AFTER)
    return Saved(path, at_save, stateful, losses, clone_state(run.model))


@pytest.fixture
def ckpt_copy(saved, tmp_path) -> Path:
    """A copy of the saved checkpoint that a test may damage."""
    return Path(shutil.copytree(saved.path, tmp_path / saved.path.name))


# ---------------------------------------------------------------------------------------------------- round trip


def test_resume_gives_bitwise_identical_losses(saved):
    run = make_run(OTHER_SEED)
    torch.manual_seed(OTHER_SEED)  # a different RNG state than at save time: load must restore it
    extra = load_checkpoint(saved.path, model=run.model, optimizer=run.optimizer, scaler=run.scaler,
                            guard=run.guard, loader=run.loader)
    assert extra == EXTRA
    assert_states_equal(clone_state(run.model), saved.state_at_save)  # FP8 amax histories and scales included
    assert {"scaler": run.scaler.state_dict(), "guard": run.guard.state_dict(),
            "loader": run.loader.state_dict()} == saved.stateful_at_save
    assert train(run, STEPS_AFTER) == saved.losses_after
    assert_states_equal(clone_state(run.model), saved.state_after)


def test_fp8_scaling_state_is_saved(saved):
    fp8_keys = [k for k in saved.state_at_save if ".fp8_state." in k]
    assert any(k.endswith("amax_history") for k in fp8_keys) and any(k.endswith(".scale") for k in fp8_keys)
    assert any(saved.state_at_save[k].any() for k in fp8_keys if k.endswith("amax_history"))  # trained, not zeros
    with safe_open(saved.path / TENSORS_FILE, framework="pt") as f:
        for key in fp8_keys:
            assert torch.equal(f.get_tensor(f"model/{key}"), saved.state_at_save[key]), key


def test_tied_weights_are_stored_once_and_stay_tied(saved):
    manifest = json.loads((saved.path / MANIFEST_FILE).read_text())
    assert manifest["model"]["lm_head.weight"] == manifest["model"]["wte.weight"] == "model/wte.weight"
    assert "model/lm_head.weight" not in manifest["tensors"]
    model = fp8_llama(OTHER_SEED)
    load_checkpoint(saved.path, model=model)
    assert model.lm_head.weight is model.wte.weight
    assert torch.equal(model.lm_head.weight, saved.state_at_save["lm_head.weight"])


def test_manifest_describes_the_tensors(saved):
    manifest = json.loads((saved.path / MANIFEST_FILE).read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["minifloat_version"] == mf.__version__ and manifest["torch_version"] == torch.__version__
    data = (saved.path / TENSORS_FILE).read_bytes()
    assert manifest["tensors_file"] == {"name": TENSORS_FILE, "bytes": len(data),
                                        "sha256": hashlib.sha256(data).hexdigest()}
    with safe_open(saved.path / TENSORS_FILE, framework="pt") as f:
        assert set(f.keys()) == set(manifest["tensors"])
        for name in f.keys():
            assert list(f.get_slice(name).get_shape()) == manifest["tensors"][name]["shape"], name
    assert manifest["tensors"]["optim/state/0/exp_avg"]["shape"] == [256, 64]  # wte.weight, the first parameter
    assert manifest["tensors"]["rng/torch"]["dtype"] == "uint8"
    assert [len(g["params"]) for g in manifest["optimizer"]["param_groups"]] == [15, 5]


# (name, value): kept exactly through the manifest's JSON
EXTRA_CASES = [
    ("tuple", (1, "a", (2.5, None))),
    ("non-finite floats", [math.inf, -math.inf]),
    ("int keys", {0: "zero", 7: [1, 2]}),
    ("reserved-looking keys", {"__tensor__": "not a tensor", "__tuple__": []}),
    ("tensor", {"w": torch.arange(6, dtype=torch.int16).view(2, 3)}),
    ("data manifest", {"root": "/data", "digest": "ab" * 32, "files": [{"path": "a.py", "nbytes": 3}]}),
]


@pytest.mark.parametrize("name, value", EXTRA_CASES, ids=[c[0] for c in EXTRA_CASES])
def test_extra_round_trips(tmp_path, name, value):
    model = fp8_llama(SEED)
    save_checkpoint(tmp_path / "c", model=model, extra={"value": value})
    loaded = load_checkpoint(tmp_path / "c", model=model)["value"]
    if name == "tensor":
        assert torch.equal(loaded["w"], value["w"]) and loaded["w"].dtype == value["w"].dtype
    else:
        assert loaded == value


def test_nan_in_extra_round_trips(tmp_path):
    model = fp8_llama(SEED)
    save_checkpoint(tmp_path / "c", model=model, extra={"loss": math.nan})
    assert math.isnan(load_checkpoint(tmp_path / "c", model=model)["loss"])


def test_rng_states_are_restored(tmp_path):
    np = pytest.importorskip("numpy")
    model = fp8_llama(SEED)
    save_checkpoint(tmp_path / "c", model=model)
    draws = (random.random(), torch.rand(3), np.random.rand(3))
    load_checkpoint(tmp_path / "c", model=model)
    again = (random.random(), torch.rand(3), np.random.rand(3))
    assert draws[0] == again[0] and torch.equal(draws[1], again[1]) and (draws[2] == again[2]).all()


def test_restore_rng_false_leaves_generators(tmp_path):
    model = fp8_llama(SEED)
    save_checkpoint(tmp_path / "c", model=model)
    state = torch.get_rng_state()
    torch.rand(3)
    moved = torch.get_rng_state()
    load_checkpoint(tmp_path / "c", model=model, restore_rng=False)
    assert torch.equal(torch.get_rng_state(), moved) and not torch.equal(moved, state)


# ---------------------------------------------------------------------------------- damaged and mismatched input


def cut_tensors(path: Path) -> None:
    data = (path / TENSORS_FILE).read_bytes()
    (path / TENSORS_FILE).write_bytes(data[: len(data) // 2])


def flip_byte(path: Path) -> None:
    data = bytearray((path / TENSORS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (path / TENSORS_FILE).write_bytes(bytes(data))


def edit_manifest(**changes):
    def edit(path: Path) -> None:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        manifest.update(changes)
        (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    return edit


def change_manifest(change):
    """A damage that calls change(manifest) on the parsed manifest and writes it back."""
    def damage(path: Path) -> None:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
        change(manifest)
        (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    return damage


def not_safetensors(path: Path) -> None:
    """Replace the tensor file by other bytes, with a manifest that vouches for them (size and hash)."""
    (path / TENSORS_FILE).write_bytes(b"not a safetensors file")
    change_manifest(lambda m: m["tensors_file"].update(bytes=22, sha256=hashlib.sha256(
        b"not a safetensors file").hexdigest()))(path)


def cut_manifest(path: Path) -> None:
    text = (path / MANIFEST_FILE).read_text()
    (path / MANIFEST_FILE).write_text(text[: len(text) // 2])


def drop_manifest_key(path: Path, key: str) -> None:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    del manifest[key]
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


# (name, damage, error type, pattern the message must match)
DAMAGE_CASES = [
    ("truncated tensors", cut_tensors, CheckpointError, r"tensors\.safetensors is truncated"),
    ("flipped byte", flip_byte, CheckpointError, r"tensors\.safetensors is corrupt: sha256"),
    ("missing tensors", lambda p: (p / TENSORS_FILE).unlink(), CheckpointError, r"tensors\.safetensors is missing"),
    ("truncated manifest", cut_manifest, CheckpointError, r"manifest\.json is not valid JSON"),
    ("missing manifest", lambda p: (p / MANIFEST_FILE).unlink(), CheckpointError, r"manifest\.json is missing"),
    ("format version", edit_manifest(format_version=99), CheckpointError,
     rf"format version 99.*format version {FORMAT_VERSION}"),
    ("manifest lacks an entry", lambda p: drop_manifest_key(p, "model"), CheckpointError,
     r"lacks the entries \['model'\]"),
    ("no such directory", lambda p: shutil.rmtree(p), FileNotFoundError, r"does not exist"),
    # a malformed manifest (a hand edit, another program) raises CheckpointError, never AttributeError or KeyError
    ("tensors a list", edit_manifest(tensors=[]), CheckpointError, r"entry 'tensors' is a list, not a dict"),
    ("optimizer a list", edit_manifest(optimizer=[]), CheckpointError, r"entry 'optimizer' is a list, not a dict"),
    ("tensors_file without bytes", change_manifest(lambda m: m["tensors_file"].pop("bytes")), CheckpointError,
     r"step_000003 is malformed \(KeyError: 'bytes'\)"),
    ("a tensor spec a string", change_manifest(lambda m: m["tensors"].update({"model/wte.weight": "float32"})),
     CheckpointError, r"is malformed \(TypeError"),
    ("model key to an unstored tensor", change_manifest(lambda m: m["model"].update({"wte.weight": "nowhere"})),
     CheckpointError, r"is malformed \(KeyError: 'nowhere'\)"),
    ("a malformed tag", change_manifest(lambda m: m["extra"].update(step={"__tuple__": 3})), CheckpointError,
     r"is malformed \(TypeError"),
    ("not safetensors", not_safetensors, CheckpointError, r"is malformed \(SafetensorError"),
    ("loader state of another kind", change_manifest(lambda m: m["loader"].update(position=-1)), CheckpointError,
     r"saved state in .* is malformed \(ValueError: position must be an int >= 0"),
    ("RNG state not restorable", change_manifest(lambda m: m["rng"].update(torch=[1, 2])), CheckpointError,
     r"saved state in .* is malformed \(TypeError"),
]


@pytest.mark.parametrize("name, damage, error, pattern", DAMAGE_CASES, ids=[c[0] for c in DAMAGE_CASES])
def test_damaged_checkpoint_raises_and_changes_nothing(ckpt_copy, name, damage, error, pattern):
    damage(ckpt_copy)
    run = make_run(OTHER_SEED)
    train(run, 1)  # optimizer state to compare
    before, optim_before = clone_state(run.model), run.optimizer.state_dict()
    with pytest.raises(error, match=pattern):
        load_checkpoint(ckpt_copy, model=run.model, optimizer=run.optimizer, scaler=run.scaler, loader=run.loader)
    assert_states_equal(clone_state(run.model), before)
    assert run.optimizer.state_dict() == optim_before  # same tensor objects: nothing replaced
    assert run.loader.position == 1


# the damage whose line ends with how to recover (another format version has another fix: another release)
FIXABLE = [case for case in DAMAGE_CASES if case[2] is CheckpointError and case[0] != "format version"]


@pytest.mark.parametrize("name, damage, error, pattern", FIXABLE, ids=[c[0] for c in FIXABLE])
def test_damage_is_named_with_its_fix(ckpt_copy, name, damage, error, pattern):
    """What is wrong stays in the line (the pattern), and the fix follows it, within what the command line prints."""
    damage(ckpt_copy)
    run = make_run(OTHER_SEED)
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_checkpoint(ckpt_copy, model=run.model, optimizer=run.optimizer, scaler=run.scaler, loader=run.loader)
    message = " ".join(str(info.value).split())  # as the command line prints it
    assert message.endswith(f"; {ckpt.CHECKPOINT_FIX}") and "--overwrite" in message, message
    assert len(message) <= MESSAGE_LIMIT, len(message)


def test_a_saved_checkpoint_gets_the_umask_mode(tmp_path):
    """Not mkdtemp's 0700 nor the 0600 safetensors writes: the folder and every file get what the umask gives new
    ones, the first checkpoint and the one that replaces it."""
    umask = 0o027
    old = os.umask(umask)
    try:
        for step in (1, 2):
            path = save_checkpoint(tmp_path / "ckpt", model=torch.nn.Linear(2, 2), extra={"step": step},
                                   files={"tokenizer.json": b"{}"})
            modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [path, *path.iterdir()]}
            assert modes == {"ckpt": 0o777 & ~umask, TENSORS_FILE: 0o666 & ~umask, MANIFEST_FILE: 0o666 & ~umask,
                             "tokenizer.json": 0o666 & ~umask}, {k: oct(v) for k, v in modes.items()}
    finally:
        os.umask(old)


# (name, model that does not fit the checkpoint, key the error names)
MISMATCH_CASES = [
    ("wider", lambda: fp8_llama(SEED, d_model=128), "wte.weight"),
    ("deeper", lambda: fp8_llama(SEED, n_layer=3), "blocks.2.attn_norm.weight"),
    ("not converted", lambda: Llama(LlamaConfig.preset("tiny")), "blocks.0.attn.o_proj.fp8_state.amax_history"),
    ("longer amax history", lambda: fp8_llama(SEED, mf.DelayedScaling(amax_history_len=8)), "fp8_state.amax_history"),
    ("untied head", lambda: fp8_llama(SEED, tie_embeddings=False), "lm_head.weight"),
    ("bf16", lambda: fp8_llama(SEED).to(torch.bfloat16), "dtype torch.float32 in the checkpoint"),
]


@pytest.mark.parametrize("name, build, key", MISMATCH_CASES, ids=[c[0] for c in MISMATCH_CASES])
def test_mismatched_model_raises_naming_the_key(saved, name, build, key):
    model = build()
    before = clone_state(model)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_checkpoint(saved.path, model=model)
    assert_states_equal(clone_state(model), before)


def test_mismatch_message_lists_a_few_keys_and_counts_the_rest(saved):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(saved.path, model=fp8_llama(SEED, n_layer=8))
    message = str(info.value)
    assert message.startswith(f"the checkpoint {saved.path} (65 tensors) does not fit the model (")
    assert re.search(r"missing from the checkpoint: blocks\.2\.attn_norm\.weight, \S+, \S+ and \d+ more$", message)
    assert len(message) < MESSAGE_LIMIT


def test_failed_rng_restore_puts_back_what_it_changed(ckpt_copy):
    change_manifest(lambda m: m["rng"].update(torch=[1, 2]))(ckpt_copy)  # python's state loads, torch's refuses
    run = make_run(OTHER_SEED)
    random.seed(OTHER_SEED)
    python_state, loader_state = random.getstate(), run.loader.state_dict()
    with pytest.raises(CheckpointError, match="TypeError"):
        load_checkpoint(ckpt_copy, model=run.model, loader=run.loader)
    assert random.getstate() == python_state
    assert run.loader.state_dict() == loader_state


def test_checkpoint_extra_raises_on_a_malformed_manifest(ckpt_copy):
    edit_manifest(extra=[1])(ckpt_copy)
    with pytest.raises(CheckpointError, match="entry 'extra' is a list, not a dict"):
        checkpoint_extra(ckpt_copy)


def test_mismatched_optimizer_raises_before_touching_the_model(saved):
    model = fp8_llama(OTHER_SEED)
    before = clone_state(model)
    with pytest.raises(CheckpointError, match=r"parameter groups of sizes \[15, 5\].*\[20\]"):
        load_checkpoint(saved.path, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    assert_states_equal(clone_state(model), before)


def test_other_optimizer_type_raises(saved):
    model = fp8_llama(OTHER_SEED)
    with pytest.raises(CheckpointError, match="optimizer is a AdamW, the optimizer given is a SGD"):
        load_checkpoint(saved.path, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_missing_section_raises(tmp_path):
    model = fp8_llama(SEED)
    save_checkpoint(tmp_path / "c", model=model)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        load_checkpoint(tmp_path / "c", model=model, optimizer=torch.optim.AdamW(model.parameters()))


def test_disabled_scaler_state_into_enabled_scaler_raises(tmp_path):
    model = fp8_llama(SEED)
    save_checkpoint(tmp_path / "c", model=model, scaler=mf.LossScaler(enabled=False))
    with pytest.raises(CheckpointError, match="disabled loss scaler"):
        load_checkpoint(tmp_path / "c", model=model, scaler=mf.LossScaler(enabled=True))


# ------------------------------------------------------------------------------------------------ atomic writes


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = fp8_llama(SEED)
    path = save_checkpoint(tmp_path / "step_1", model=model, extra={"step": 1})
    files = {f.name: f.read_bytes() for f in path.iterdir()}

    def failing_writer(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", failing_writer)
    with torch.no_grad():
        model.wte.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, model=model, extra={"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]  # no temporary directory left
    assert {f.name: f.read_bytes() for f in path.iterdir()} == files
    monkeypatch.undo()
    assert load_checkpoint(path, model=fp8_llama(SEED)) == {"step": 1}


def test_save_replaces_a_checkpoint(tmp_path):
    model = fp8_llama(SEED)
    save_checkpoint(tmp_path / "c", model=model, extra={"step": 1})
    save_checkpoint(tmp_path / "c", model=model, extra={"step": 2})
    assert load_checkpoint(tmp_path / "c", model=model) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


def test_save_refuses_to_replace_other_folders(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        save_checkpoint(tmp_path / "notes", model=fp8_llama(SEED))
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_files_travel_with_the_checkpoint_and_bad_names_are_refused(tmp_path, sharded):
    """`files` (a token run's tokenizer.json) are written into the checkpoint as they are, by either writer; a name
    that is not a plain one, or one of the checkpoint's own files, is refused and nothing is left behind."""
    from minifloat.training.parallel import World
    from minifloat.training.sharded import read_extra, save_sharded

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())

    def save(path, files):
        if sharded:
            return save_sharded(path, model=model, optimizer=optimizer, world=World(), extra={"step": 1}, files=files)
        return save_checkpoint(path, model=model, optimizer=optimizer, extra={"step": 1}, files=files)

    path = save(tmp_path / "c", {"tokenizer.json": b'{"model": 1}'})
    assert (path / "tokenizer.json").read_bytes() == b'{"model": 1}' and read_extra(path) == {"step": 1}
    own = "state.json" if sharded else MANIFEST_FILE
    for name in ("../escape.json", "sub/tokenizer.json", "", own):
        with pytest.raises(ValueError, match="plain name of its own"):
            save(tmp_path / "d", {name: b"x"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary folder, nothing escaped


def test_unstorable_value_raises_before_writing(tmp_path):
    with pytest.raises(ValueError, match=r"extra/config/callback: a function cannot be stored"):
        save_checkpoint(tmp_path / "c", model=fp8_llama(SEED), extra={"config": {"callback": lambda: None}})
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------------ no pickle


def test_checkpoint_holds_no_pickle_and_loads_without_it(saved, monkeypatch):
    assert {p.suffix for p in saved.path.iterdir()} == {".safetensors", ".json"}

    def refuse(*args, **kwargs):
        raise AssertionError("pickle-based loading was used")

    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads"), (pickle, "Unpickler")):
        monkeypatch.setattr(module, name, refuse)
    run = make_run(OTHER_SEED)
    load_checkpoint(saved.path, model=run.model, optimizer=run.optimizer, scaler=run.scaler, guard=run.guard,
                    loader=run.loader)
    assert_states_equal(clone_state(run.model), saved.state_at_save)


def test_a_killed_checkpoints_temporary_folder_is_removed_by_the_next_save(tmp_path):
    """A SIGKILL while a checkpoint is written leaves `.ckpt.tmp-PID-*` (gigabytes for a large model): the next save
    beside it removes it; a live process's stays, and so does a folder the name does not say is ours."""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that no longer runs
    abandoned = tmp_path / f".ckpt.tmp-{dead.pid}-abc123"
    live = tmp_path / f".ckpt.tmp-{os.getppid()}-def456"
    other = tmp_path / ".ckpt.tmp-notapid"
    for folder in (abandoned, live, other):
        folder.mkdir()
        (folder / "tensors.safetensors").write_bytes(b"\0" * 8)
    save_checkpoint(tmp_path / "ckpt", model=torch.nn.Linear(4, 4))
    assert not abandoned.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name, "ckpt"])


def test_a_folder_that_is_not_a_checkpoint_is_named_for_what_it_is(tmp_path):
    """A run's folder given for its checkpoint says where the checkpoint is; a folder without any checkpoint file
    says it is none (not "restore the checkpoint from a backup", which fits a damaged one)."""
    save_checkpoint(tmp_path / "run" / "ckpt", model=torch.nn.Linear(4, 4))
    with pytest.raises(ckpt.CheckpointError, match=f"{tmp_path / 'run'} is a run folder, not a checkpoint: its "
                                                   f"checkpoint is {tmp_path / 'run' / 'ckpt'}"):
        load_checkpoint(tmp_path / "run", model=torch.nn.Linear(4, 4))
    (tmp_path / "other").mkdir()
    with pytest.raises(ckpt.CheckpointError, match="is not a checkpoint \\(it holds no manifest.json\\)"):
        load_checkpoint(tmp_path / "other", model=torch.nn.Linear(4, 4))
    (tmp_path / "run" / "ckpt" / "manifest.json").unlink()  # a damaged checkpoint: the backup advice
    with pytest.raises(ckpt.CheckpointError, match="manifest.json is missing; .* restore the checkpoint from a backup"):
        load_checkpoint(tmp_path / "run" / "ckpt", model=torch.nn.Linear(4, 4))
