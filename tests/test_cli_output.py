"""What the `minifloat` command line prints for people (issue 22, item 5): argparse's own errors as one line naming
the flag, OS errors naming the option, the library's Python spellings put as flags, progress bars named by preset,
warnings that never land on a bar's line, tables whole in 80 columns and in logs, and a `--help` that imports no
command's heavy modules.

Errors run main() in-process (each fails before any work); one case runs `python -m minifloat` itself.
"""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import pytest
import rich
from rich.console import Console
from rich.progress import Progress

from minifloat.cli import common, library_logging, main, os_error_line, with_flags
from minifloat.safety.audit import AuditReport, OpRecord

USER_ERROR = 2  # main()'s exit status for a bad option or input


def one_error_line(capsys, argv: list[str]) -> str:
    """main(argv)'s one stderr line, after checking the exit status, that nothing else was printed, and no traceback."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == USER_ERROR, (status, err)
    assert err.count("\n") == 1 and err.startswith("minifloat: error: ") and "Traceback" not in err, err
    assert out == ""  # no usage block on stdout either
    return err.strip()


# ---- argparse's own errors ----------------------------------------------------------------------------------------

# (name, argv, words the error line holds): each caught by argparse before the command runs
ARGPARSE_CASES = [
    ("train --steps abc", ["train", "--steps", "abc"], ["--steps", "'abc'", "see minifloat train --help"]),
    ("train --parallel bogus", ["train", "--parallel", "bogus"], ["--parallel", "'bogus'", "ddp"]),
    ("audit --model huge", ["audit", "--model", "huge"], ["--model", "'huge'", "see minifloat audit --help"]),
    ("export without --out", ["export", "--run", "runs/x"], ["required", "--out", "see minifloat export --help"]),
    ("compare --steps 1.5", ["compare", "--steps", "1.5"], ["--steps", "'1.5'"]),
    ("demo --batch x", ["demo", "--batch", "x"], ["--batch", "'x'"]),
    ("unknown flag", ["formats", "--bogus"], ["unrecognized arguments: --bogus", "see minifloat formats --help"]),
    ("unknown command", ["trian"], ["'trian'", "train", "see minifloat --help"]),
    ("no command", [], ["required: command"]),
]


@pytest.mark.parametrize("name, argv, words", ARGPARSE_CASES, ids=[c[0] for c in ARGPARSE_CASES])
def test_argparse_errors_are_one_line_naming_the_flag(capsys, name, argv, words):
    line = one_error_line(capsys, argv)
    assert all(w in line for w in words), line


def test_python_m_minifloat_prints_one_error_line():
    done = subprocess.run([sys.executable, "-m", "minifloat", "train", "--steps", "abc"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == USER_ERROR
    assert done.stderr.splitlines() == ["minifloat: error: argument --steps: invalid int value: 'abc' "
                                        "(see minifloat train --help)"]
    assert done.stdout == ""


def test_a_reader_that_closes_the_pipe_gets_no_error():
    # `minifloat formats --json | head` printed "minifloat: error: [Errno 32] Broken pipe"
    cli = subprocess.Popen([sys.executable, "-m", "minifloat", "formats", "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    cli.stdout.close()  # the reader goes away before the writer (still importing) writes a byte
    err = cli.stderr.read()
    assert cli.wait(timeout=300) == 141 and err.decode() == ""  # 128 + SIGPIPE, as a shell reports it


def test_ctrl_c_before_the_command_starts_is_one_line(monkeypatch, capsys):
    # Ctrl-C while the command's modules (torch) were importing printed a traceback ending in KeyboardInterrupt
    import minifloat.cli as cli

    def interrupted(_commands):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["train", "--steps", "3"]) == 130
    assert capsys.readouterr().err.strip() == "minifloat: error: interrupted"


def test_ctrl_c_while_a_rank_imports_torch_is_one_line(monkeypatch, capsys):
    # a rank (`python -m minifloat.train`, what --nproc starts) imported torch before anything caught Ctrl-C
    import builtins

    import minifloat.train as rank

    real = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "torch.distributed":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert rank.run(["--steps", "3"]) == 130
    assert capsys.readouterr().err.strip() == "minifloat: error: interrupted"


def test_help_imports_no_command_module():
    """`minifloat --help` lists the commands without building their options, whose defaults come from modules that
    import torch, matplotlib or transformers; and `import minifloat` imports its public names on first use, so neither
    loads torch (2.5 s on a 2-core CPU) nor torch's compiler (2.3 s more). `minifloat --help` took 2.7-4 s before,
    0.25 s after (2-core AMD EPYC): a timing, not asserted."""
    code = ("import sys\nfrom minifloat.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'transformers', 'torch') or m in "
            "('minifloat.training.loop', 'minifloat.training.compare', 'minifloat.training.config', "
            "'minifloat.inference.export', 'minifloat.inference.hf')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    *help_text, imported = done.stdout.splitlines()
    assert "compare" in "\n".join(help_text) and "export" in "\n".join(help_text)
    assert imported == "[]"


# ---- errors raised while the command runs -------------------------------------------------------------------------

def test_an_os_error_names_the_option(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    out = blocker / "run"
    line = one_error_line(capsys, ["train", "--model", "tiny", "--steps", "1", "--max-bytes", "100000", "--out",
                                   str(out)])
    assert line == f"minifloat: error: --out {out}: Not a directory"


class Args:
    out = "/proc/x"
    data = "corpus"


FLAGS = {"out": "--out", "data": "--data"}
# (name, the OSError, the line): Python's "[Errno N] ...: 'path'" becomes the option, its value and the reason
OS_ERROR_CASES = [
    ("the option's path", FileNotFoundError(2, "No such file or directory", "/proc/x"),
     "--out /proc/x: No such file or directory"),
    ("inside it", PermissionError(13, "Permission denied", "corpus/a.txt"),
     "--data corpus: Permission denied (corpus/a.txt)"),
    ("a temporary sibling", FileNotFoundError(2, "No such file or directory", "/proc/.x.tmp-1234"),
     "--out /proc/x: No such file or directory (/proc/.x.tmp-1234)"),
    ("no option's", FileNotFoundError(2, "No such file or directory", "/etc/other"),
     "/etc/other: No such file or directory"),
    ("no path", OSError("the library's own message"), "the library's own message"),
]


@pytest.mark.parametrize("name, err, line", OS_ERROR_CASES, ids=[c[0] for c in OS_ERROR_CASES])
def test_os_error_line(name, err, line):
    assert os_error_line(err, Args(), FLAGS) == line


# (name, message, the line): the library names its fields; the command line's user knows them as flags
SPELLING_CASES = [
    ("field='value'", "use activations='dynamic' otherwise", "use --activations dynamic otherwise"),
    ("field=value", "got keep_blocks=0,1 here", "got --keep-blocks 0,1 here"),
    ("a field that must be something", "keep_blocks must be FIRST,LAST", "--keep-blocks must be FIRST,LAST"),
    ("a field as a word is kept", "the steps of the run ran", "the steps of the run ran"),
    # a name with an underscore is no plain word: "fp8_margin overrides ..." used to reach the user as Python
    ("a field with an underscore", "keep_blocks keeps none, see keep_blocks.", "--keep-blocks keeps none, see "
                                                                                "--keep-blocks."),
    ("a longer name is kept", "keep_blocks_x is other", "keep_blocks_x is other"),
    ("a switch", "pass overwrite=True to replace it", "pass --overwrite to replace it"),
    ("a path is kept", "no file /tmp/keep_blocks=1/a", "no file /tmp/keep_blocks=1/a"),
    ("another field is kept", "max_seq_len=128 is too short", "max_seq_len=128 is too short"),
]


@pytest.mark.parametrize("name, message, line", SPELLING_CASES, ids=[c[0] for c in SPELLING_CASES])
def test_python_spellings_become_flags(name, message, line):
    flags = {"activations": "--activations", "keep_blocks": "--keep-blocks", "steps": "--steps",
             "overwrite": "--overwrite"}
    assert with_flags(message, flags) == line


# ---- progress bars and warnings -----------------------------------------------------------------------------------

@pytest.fixture
def terminal(monkeypatch) -> Console:
    """A terminal rich draws live progress bars on, as the default console (the training loop's)."""
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    monkeypatch.setattr(rich, "_console", console)
    return console


def screen(console: Console) -> list[str]:
    """The lines a terminal shows after `console`'s output: a live display rewrites its lines in place with carriage
    returns, "erase line" and "cursor up" codes; every other escape code (colour) is dropped."""
    lines, row = [""], 0
    for token in re.split(r"(\n|\r|\x1b\[2K|\x1b\[1A|\x1b\[[0-9;?]*[A-Za-z])", console.file.getvalue()):
        if token == "\n":
            row += 1
            lines += [""] * (row + 1 - len(lines))
        elif token == "\x1b[2K":
            lines[row] = ""
        elif token == "\x1b[1A":
            row = max(0, row - 1)
        elif token and token != "\r" and not token.startswith("\x1b"):
            lines[row] += token  # the live display erases a line before it writes it: no column to track
    return [line for line in lines if line]


def test_the_training_bar_names_the_preset(terminal, tmp_path):
    from minifloat.training.loop import TrainConfig, train

    train(TrainConfig(model="tiny", preset="fp8-current", steps=2, batch_size=2, seq_len=32, eval_every=2,
                      eval_batches=1, max_bytes=100_000, checkpoint_every=0, out=str(tmp_path)))
    (bar,) = [line for line in screen(terminal) if "2/2" in line]
    assert bar.startswith("fp8-current "), bar


def test_a_warning_gets_its_own_line_above_the_bar(terminal):
    with library_logging(verbose=False), Progress(console=terminal, auto_refresh=False) as bar:
        task = bar.add_task("bf16", total=4)
        bar.advance(task)
        bar.refresh()
        logging.getLogger("minifloat").warning("minifloat: something to know")
        bar.advance(task)
        bar.refresh()
    lines = screen(terminal)
    assert lines[0] == "minifloat: something to know"  # a line of its own, above the bar, not glued onto it
    assert lines[1].startswith("bf16 ") and "50%" in lines[1] and len(lines) == 2, lines


# ---- tables -------------------------------------------------------------------------------------------------------

LONG_NAME = "model.layers.31.self_attn.q_proj"  # a Hugging Face Llama's, longer than 80-column cells allow


def audit_report() -> AuditReport:
    ops = [("aten.mm.default", "bfloat16"), ("aten.embedding_dense_backward.default", "float32")]
    records = [OpRecord(LONG_NAME, "Linear", phase, op, ["bfloat16"], ["bfloat16"], precision)
               for phase in ("forward", "backward") for op, precision in ops]
    return AuditReport(records=records, violations=[], head=None)


@pytest.mark.parametrize("terminal_width", [None, 80], ids=["log", "80-column terminal"])
def test_audit_table_shows_whole_layer_names(monkeypatch, terminal_width):
    if terminal_width is None:  # a log: not a terminal, where rich assumes 80 columns
        console = Console(file=io.StringIO(), width=80, record=True)
    else:
        console = Console(file=io.StringIO(), width=terminal_width, force_terminal=True, record=True)
    monkeypatch.setattr(common, "console", console)
    common.print_table(audit_report().table(full=True))
    text = console.export_text()
    assert "…" not in text and text.count(LONG_NAME) == 4, text
    assert "aten.mm " in text and "aten.mm.default" not in text  # the default overload is not spelled out
    assert "rule broken" not in text  # no violation, no column for one
    if terminal_width is not None:
        assert max(len(line) for line in text.splitlines()) <= terminal_width
    assert console.width == 80  # restored


def test_a_long_line_stays_one_line_in_a_log(monkeypatch):
    """The commands' console prints a line of text whole where the output is a log or pipe (rich would assume 80
    columns and break it): "continue with --resume" stays on the line it belongs to."""
    console = Console(file=io.StringIO(), soft_wrap=common.console.soft_wrap)
    assert not console.is_terminal and console.width == 80
    line = "stopped by SIGINT at step 148/4000; checkpoint in runs/a-long-run-name/ckpt; continue with --resume"
    console.print(line, highlight=False)
    assert console.file.getvalue() == line + "\n"


def test_the_telemetry_table_is_whole_in_a_log(capsys):
    """tel.print_table() into a log or pipe: every cell whole, not cut to "…" at 80 columns."""
    import torch

    import minifloat as mf
    from minifloat.fp8 import telemetry

    model = mf.convert(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
                       recipe=mf.DelayedScaling(), keep_first_last=False)
    with telemetry.capture() as tel:
        model(torch.randn(8, 64)).sum().backward()
    tel.print_table()
    out = capsys.readouterr().out
    assert "…" not in out and "grad_output" in out and "tensor" in out, out


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and re.fullmatch(r"minifloat \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)
