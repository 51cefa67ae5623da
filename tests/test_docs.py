"""The Python blocks of docs/policy.md run, in order, as one script (the page promises it); README's test command is
CI's, and the suite collects with and without pytest-xdist."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_policy_page_examples_run(capsys):
    blocks = python_blocks(DOCS / "policy.md")
    assert len(blocks) >= 6, "the page lost its examples"
    namespace: dict = {"__name__": "docs_policy"}
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/policy.md block {i}", "exec"), namespace)
        except Exception as exc:  # noqa: BLE001 - name the failing block
            pytest.fail(f"docs/policy.md block {i} failed: {type(exc).__name__}: {exc}\n{block}")
    out = capsys.readouterr().out
    assert "RollbackEvent(restored_step=40, resume_data_position=43, skip_batches=3)" in out


def test_ci_runs_the_readmes_test_command():
    """.ci/run is README's test command, word for word (CI proves what a user runs)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    commands = [line for line in (root / "README.md").read_text().splitlines()
                if line.startswith("pip install") and "pytest" in line]
    assert len(commands) == 1, commands
    assert commands[0] in (root / ".ci" / "run").read_text().splitlines()


def test_the_suite_runs_without_pytest_xdist(tmp_path):
    """The GPU machine's pytest has no xdist: `python -m pytest -m gpu` there must still collect (tests/conftest.py's
    xdist hook is optional)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--collect-only",
                           "-q", "tests/test_docs.py"], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "test_ci_runs_the_readmes_test_command" in done.stdout, done.stdout + done.stderr
