"""The `minifloat` command line's user errors: each one exits with status 2 and prints exactly one line on stderr that
names the flag, file or folder at fault, and no traceback, before any long work starts. Also the demo's progress
lines when stdout is not a terminal (a log).

Every case runs main() in-process; the errors are raised before training, so the table takes a few seconds.
"""

from __future__ import annotations

import io
import json
import pathlib

import pytest
import torch
from rich.console import Console

from minifloat.cli import common, main, with_flags
from minifloat.training.checkpoint import MANIFEST_FILE, save_checkpoint

USER_ERROR = 2  # main()'s exit status for a bad option or input
DEMO = ["demo", "--steps", "2", "--batch", "4", "--variants", "fp32,bf16"]  # about a second per variant on 2 cores
TRAIN = ["train", "--model", "tiny", "--steps", "1"]


def run(capsys, argv: list[str]) -> tuple[int, str]:
    """main(argv)'s exit status and its stderr, which must be exactly one error line without a traceback."""
    status = main(argv)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    assert lines[0].startswith("minifloat: error: ") and "Traceback" not in err
    return status, lines[0]


# ---- options ------------------------------------------------------------------------------------------------------

# (name, argv, words the error line holds)
OPTION_CASES = [
    ("demo --steps 0", ["demo", "--steps", "0"], ["invalid option", "steps", "got 0"]),
    ("demo --batch 0", ["demo", "--batch", "0"], ["invalid option", "batch", "got 0"]),
    ("demo --batch -1", ["demo", "--batch", "-1"], ["invalid option", "batch", "got -1"]),
    ("demo --seed -1", ["demo", "--seed", "-1"], ["invalid option", "seed", "got -1"]),
    ("demo unknown variant", ["demo", "--variants", "fp32,fp7"], ["invalid option", "variants", "'fp7'"]),
    ("demo repeated variant", ["demo", "--variants", "bf16,bf16"], ["invalid option", "variants", "once"]),
    ("audit --batch -2", ["audit", "--batch", "-2"], ["invalid option", "batch", "got -2"]),
    ("audit --batch 0, Llama", ["audit", "--model", "tiny", "--batch", "0"], ["invalid option", "batch", "got 0"]),
    ("audit --seed -1", ["audit", "--seed", "-1"], ["invalid option", "seed", "got -1"]),
    ("audit unknown preset", ["audit", "--preset", "fp9"], ["invalid option", "preset", "'fp9'"]),
    # --overwrite acts on --json's file only: alone it was accepted and did nothing
    ("audit --overwrite alone", ["audit", "--overwrite"], ["invalid option", "--overwrite replaces the file --json"]),
    ("memory --overwrite alone", ["memory", "--model", "tiny", "--overwrite"], ["invalid option", "add --json PATH"]),
    # a corpus too short for one sequence: the fix, not a tensor shape ("tokens must be a 1-D stream ... (9,)")
    ("memory --max-bytes 10", ["memory", "--model", "tiny", "--max-bytes", "10"], ["raise --max-bytes"]),
    # an empty path wrote into the current folder (compare, tokenize, export) or was ignored (audit --json)
    ("compare --out ''", ["compare", "--out", "", "--steps", "1"], ["--out", "an empty path"]),
    ("tokenize --out ''", ["tokenize", "--out", ""], ["--out", "an empty path"]),
    ("export --out ''", ["export", "--run", "r", "--out", ""], ["--out", "an empty path"]),
    ("demo --out ''", ["demo", "--out", ""], ["--out", "an empty path"]),
    ("audit --json ''", ["audit", "--json", ""], ["--json", "an empty path"]),
    ("memory --json ''", ["memory", "--model", "tiny", "--json", ""], ["--json", "an empty path"]),
    # an empty list ran every variant, where compare --presets '' is refused
    ("demo --variants ''", ["demo", "--variants", ""], ["invalid option", "variants", "got ''"]),
    # bytes that are not UTF-8 reach Python as surrogates: "'utf-8' codec can't encode characters" named no flag
    ("generate --prompt not UTF-8", ["generate", "--run", "r", "--prompt", "\udcff\udcfe"], ["--prompt", "not UTF-8"]),
]


def test_an_optional_flag_is_never_said_to_take_none():
    # "--top-k must be an int in [1, 256] or None": None is the flag left out, which no one can type
    assert with_flags("invalid option: top_k must be an int in [1, 256] or None, got 0", {"top_k": "--top-k"}) == \
        "invalid option: --top-k must be an int in [1, 256], got 0"
    assert with_flags("top_k must be an int in [1, 256] or None, got 0", {}) == \
        "top_k must be an int in [1, 256] or None, got 0"  # the library's own spelling, where None can be passed


def test_a_file_given_as_run_folder_is_named_as_a_file(capsys, tmp_path):
    (tmp_path / "log.csv").write_text("step,loss\n")
    status, line = run(capsys, ["generate", "--run", str(tmp_path / "log.csv"), "--prompt", "x"])
    assert status == USER_ERROR and "is a file, not a run folder" in line, line


@pytest.mark.parametrize("name, argv, words", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_invalid_option_is_one_line(capsys, name, argv, words):
    status, line = run(capsys, argv)
    assert status == USER_ERROR
    assert all(w in line for w in words), line


# (command and output flag, the words of the error line for a path under a file)
UNDER_A_FILE = [(["demo", *DEMO[1:], "--out"], "out", "cannot create the folder"),
                (["audit", "--json"], "audit.json", "a-file is a file, not a folder"),
                (["memory", "--model", "tiny", "--json"], "memory.json", "a-file is a file, not a folder")]


@pytest.mark.parametrize("command, name, words", UNDER_A_FILE, ids=["demo", "audit", "memory"])
def test_output_under_a_file_is_refused_before_the_work(capsys, tmp_path, command, name, words):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    target = blocker / name
    status, line = run(capsys, [*command, str(target)])
    assert status == USER_ERROR
    assert f"{command[-1]} {target}: " in line and words in line, line
    assert "final loss" not in capsys.readouterr().out  # nothing trained


# (name, the --json path under tmp_path, words of the error line): an output file checked before the work
JSON_PATHS = [
    ("a folder", ".", "is a folder; give the path of a file"),
    ("a missing folder", "new/sub/x.json", "the folder {tmp}/new/sub does not exist"),
]


# (command before --json, what its output shows once it ran)
JSON_COMMANDS = [(["audit", "--batch", "2"], "audit"), (["memory", "--model", "tiny"], "MiB")]


@pytest.mark.parametrize("command, ran", JSON_COMMANDS, ids=["audit", "memory"])
@pytest.mark.parametrize("name, path, words", JSON_PATHS, ids=[c[0] for c in JSON_PATHS])
def test_json_path_is_checked_before_the_work(capsys, tmp_path, command, ran, name, path, words):
    target = tmp_path / path
    status, line = run(capsys, [*command, "--json", str(target)])
    assert status == USER_ERROR
    assert f"--json {target}" in line and words.format(tmp=tmp_path) in line, line
    assert ran not in capsys.readouterr().out  # no table, no verdict: nothing ran
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder made


@pytest.mark.parametrize("command, ran", JSON_COMMANDS, ids=["audit", "memory"])
def test_an_existing_json_file_is_kept_unless_overwrite(capsys, tmp_path, command, ran):
    # audit and memory wrote their report over any file --json named (a run's log.csv, its checkpoint)
    target = tmp_path / "log.csv"
    target.write_text("step,loss\n0,5.3\n")
    status, line = run(capsys, [*command, "--json", str(target)])
    assert status == USER_ERROR and "exists; choose another path, or pass --overwrite" in line, line
    assert target.read_text() == "step,loss\n0,5.3\n"
    assert main([*command, "--json", str(target), "--overwrite"]) == 0
    assert json.loads(target.read_text())


# ---- data folders -------------------------------------------------------------------------------------------------


def _missing(root: pathlib.Path) -> None:
    pass


def _empty(root: pathlib.Path) -> None:
    root.mkdir()


def _only_binary(root: pathlib.Path) -> None:
    root.mkdir()
    for name in ("a.txt", "b.md", "c.py"):
        (root / name).write_bytes(bytes(range(256)))


def _no_text_pattern(root: pathlib.Path) -> None:
    root.mkdir()
    (root / "weights.bin").write_bytes(b"\x00\x01")


# (name, how the folder is made, words the error line holds besides the folder and --data)
DATA_CASES = [
    ("missing folder", _missing, ["does not exist"]),
    ("empty folder", _empty, ["holds no files"]),
    ("only binary files", _only_binary, ["found none", "skipped 3 binary, non-UTF-8 or unreadable"]),
    ("no file matches", _no_text_pattern, ["none of the 1 file(s)", "'*.txt'",
                                           "if weights.bin is a token shard, point --data at the file"]),
]
COMMANDS = {"train": TRAIN, "compare": ["compare", "--presets", "bf16", "--model", "tiny", "--steps", "1"]}


@pytest.mark.parametrize("command, name, make, words", [
    pytest.param(command, *case, id=f"{command}-{case[0]}")
    for command in COMMANDS for case in DATA_CASES])
def test_bad_data_folder_is_one_line(capsys, tmp_path, command, name, make, words):
    data = tmp_path / "data"
    make(data)
    status, line = run(capsys, [*COMMANDS[command], "--data", str(data), "--out", str(tmp_path / "out")])
    assert status == USER_ERROR
    assert str(data) in line and "--data" in line
    assert all(w in line for w in words), line


# ---- checkpoints --------------------------------------------------------------------------------------------------


def _with(**entries):
    return lambda manifest: {**manifest, **entries}


def _without(entry: str):
    return lambda manifest: {k: v for k, v in manifest.items() if k != entry}


# (name, the manifest written instead of a saved one, words the error line holds besides manifest.json)
CHECKPOINT_CASES = [
    ("tensors a list", _with(tensors=[]), ["entry 'tensors' is a list, not a dict"]),
    ("model a string", _with(model="wte.weight"), ["entry 'model' is a str, not a dict"]),
    ("loader a list", _with(loader=[0, 0]), ["entry 'loader' is a list, not a dict"]),
    ("manifest a list", lambda manifest: [manifest], ["format version None"]),
    ("no format version", _without("format_version"), ["format version None"]),
    ("an entry missing", _without("extra"), ["lacks the entries ['extra']"]),
]


@pytest.mark.parametrize("name, damage, words", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_corrupt_checkpoint_is_one_line(capsys, tmp_path, name, damage, words):
    out = tmp_path / "run"
    ckpt = save_checkpoint(out / "ckpt", model=torch.nn.Linear(2, 2), extra={"step": 1})
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    (ckpt / MANIFEST_FILE).write_text(json.dumps(damage(manifest)))
    status, line = run(capsys, [*TRAIN, "--out", str(out), "--resume"])
    assert status == USER_ERROR
    assert str(ckpt / MANIFEST_FILE) in line
    assert all(w in line for w in words), line


# ---- demo progress ------------------------------------------------------------------------------------------------


def test_demo_prints_a_line_per_variant_when_not_a_terminal(capsys):
    assert main(DEMO) == 0
    out = capsys.readouterr().out.splitlines()
    progress = [line for line in out if line.startswith(("fp32:", "bf16:"))]
    assert [line.split(":")[0] + ":" + line.split(":")[1].split()[0] for line in progress] == [
        "fp32:training", "fp32:final", "bf16:training", "bf16:final"]
    assert progress[0] == "fp32: training 2 steps"
    assert progress[1].startswith("fp32: final loss ") and progress[1].endswith(" ms/step")
    assert out.index(progress[-1]) < next(i for i, line in enumerate(out) if "byte-level MLP" in line)  # then the table


def test_demo_on_a_terminal_draws_a_bar_and_keeps_the_result_lines(monkeypatch):
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    monkeypatch.setattr(common, "console", terminal)
    assert main(DEMO) == 0
    text = terminal.file.getvalue()
    assert "━" in text  # the progress bar
    assert "fp32: final loss" in text and "bf16: final loss" in text
    assert "training 2 steps" not in text  # the bar names the variant instead


@pytest.mark.parametrize("rank, error, peer", [
    (1, RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:21931"), True),
    (0, RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:21931"), False),
    (1, RuntimeError("an internal error of this rank's own"), False),
], ids=["other-rank-peer-gone", "rank-0", "other-rank-own-error"])
def test_a_rank_whose_peer_stopped_says_so_in_one_line(capsys, monkeypatch, rank, error, peer):
    """Under torchrun every rank prints its own error: a rank that rank 0's one-line refusal left in a broken
    collective printed gloo's raw "Connection closed by peer" message. It now says another rank stopped first;
    rank 0, and any rank's own error, keep their message."""
    import torch.distributed as dist

    from minifloat.cli import tools

    def fail(args):
        raise error

    monkeypatch.setattr(tools, "cmd_formats", fail)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)
    status, line = run(capsys, ["formats"])
    assert status == 1
    assert ("rank 1 stopped: another rank of the run stopped first" in line) == peer, line
    assert ("Connection closed by peer" in line) == (not peer and "peer" in str(error)), line
