"""A run's tokenizer at inference (minifloat.inference.tokenizer; `minifloat generate` and `minifloat export` on runs
trained on token data): the copy its checkpoint keeps of a `minifloat tokenize` folder's or train --tokenizer's
(found from any folder), bytes for a byte run, supplied by --tokenizer for .bin shards without one, refused with one
line when missing, changed or of another vocabulary; and the end-of-text id an export names as eos / bos."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch

from minifloat.cli import main
from minifloat.cli.generate import printable
from minifloat.inference.export import export_hf
from minifloat.inference.generate import generate, load_run_model
from minifloat.inference.tokenizer import ByteTokenizer, TextTokenizer, run_tokenizer
from minifloat.numerics.compiling import eager_kernels
from minifloat.training.loop import TrainConfig, train
from minifloat.training.tokenizer import load_tokenizer, train_bpe

USER_ERROR = 2
VOCAB = 300
PROMPT = "the model trains on"
NEW_TOKENS = 5


def _train(out: pathlib.Path, **data) -> pathlib.Path:
    """A 2-step tiny run on `data` (TrainConfig's data / tokenizer), checkpointed."""
    with eager_kernels():
        train(TrainConfig(model="tiny", steps=2, batch_size=2, seq_len=16, warmup=1, eval_every=100, eval_batches=1,
                          max_bytes=100_000, checkpoint_every=2, out=str(out), device="cpu", **data), progress=False)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Text files; their `minifloat tokenize` folder (a BPE of VOCAB ids); nanoGPT shards of its ids without a
    tokenizer; and a run on each, one on the text through a copy of the tokenizer, one on the text as bytes."""
    root = tmp_path_factory.mktemp("tokens")
    words = "the model trains on tokens while scales follow amax history éàü ✓ numbers 448 57344".split()
    text = root / "text"
    text.mkdir()
    for i in range(8):
        body = " ".join(words[(i * 7 + j * j) % len(words)] for j in range(400))
        (text / f"doc{i:02d}.txt").write_text(f"# file {i}\n{body}\n", encoding="utf-8")
    tok = root / "tok"
    assert main(["tokenize", "--data", str(text), "--out", str(tok), "--vocab-size", str(VOCAB)]) == 0
    copy = root / "copy" / "tokenizer.json"  # train --tokenizer's file, which a test moves and changes
    copy.parent.mkdir()
    shutil.copyfile(tok / "tokenizer.json", copy)
    bins = root / "bins"  # nanoGPT's layout: bare uint16, no meta.json; the top id makes the vocabulary VOCAB
    bins.mkdir()
    ids = load_tokenizer(copy).tokenizer.encode((text / "doc00.txt").read_text(encoding="utf-8")).ids
    np.array([*ids, VOCAB - 1], dtype="<u2").tofile(bins / "train.bin")
    np.array(ids, dtype="<u2").tofile(bins / "val.bin")
    return {"files": root, "tok": tok, "copy": copy, "bins": bins,
            "shards": _train(root / "run-shards", data=str(tok)),
            "text": _train(root / "run-text", data=str(text), tokenizer=str(copy)),
            "bins-run": _train(root / "run-bins", data=str(bins)),
            "bytes": _train(root / "run-bytes", data=str(text))}


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _one_error_line(status: int, out: str, err: str, words: list[str]) -> None:
    lines = err.splitlines()
    assert status == USER_ERROR and out == "" and len(lines) == 1, err
    assert lines[0].startswith("minifloat: error: ") and all(w in lines[0] for w in words), lines[0]


# ---- finding the tokenizer ------------------------------------------------------------------------------------------


def test_a_tokenize_folder_run_keeps_the_tokenizer_its_meta_json_names(runs):
    tok = run_tokenizer(runs["shards"])
    kept = runs["shards"] / "ckpt" / "tokenizer.json"  # the checkpoint's copy
    assert isinstance(tok, TextTokenizer) and tok.path == kept and tok.vocab_size == VOCAB
    assert kept.read_bytes() == (runs["tok"] / "tokenizer.json").read_bytes()
    assert tok.decode(tok.encode(PROMPT + " éàü ✓")) == PROMPT + " éàü ✓"


def test_a_text_run_keeps_its_train_tokenizer(runs):
    tok = run_tokenizer(runs["text"], "ckpt")
    assert isinstance(tok, TextTokenizer) and tok.path == runs["text"] / "ckpt" / "tokenizer.json"
    assert tok.path.read_bytes() == runs["copy"].read_bytes()


def test_a_run_given_a_relative_tokenizer_generates_from_any_folder(runs, tmp_path, monkeypatch, capsys):
    """train --tokenizer with a relative path, then generate from another folder: the checkpoint's copy is found. A
    run from before the copy was kept (its copy removed here) is one line naming --tokenizer from elsewhere, and
    still finds the relative path from the folder it trained in."""
    root = runs["files"]
    monkeypatch.chdir(root)
    run = _train(tmp_path / "run", data="text", tokenizer="copy/tokenizer.json")
    monkeypatch.chdir(tmp_path)
    status, out, err = _cli(capsys, "generate", "--run", str(run), "--prompt", PROMPT, "--max-new-tokens", "3",
                            "--device", "cpu")
    assert status == 0 and out and err.count("\n") == 1, err
    (run / "ckpt" / "tokenizer.json").unlink()  # as a checkpoint written before minifloat kept the copy
    _one_error_line(*_cli(capsys, "generate", "--run", str(run), "--prompt", PROMPT),
                    [str(run), "copy/tokenizer.json", "missing from", "relative", "--tokenizer FILE"])
    monkeypatch.chdir(root)
    assert run_tokenizer(run).path == pathlib.Path("copy/tokenizer.json")


def test_a_byte_run_reads_bytes_and_refuses_a_tokenizer(runs):
    tok = run_tokenizer(runs["bytes"])
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256
    assert tok.encode("é") == [0xC3, 0xA9] and tok.decode([104, 105, 0xFF]) == "hi\ufffd"
    with pytest.raises(ValueError, match="as bytes.*leave --tokenizer out"):
        run_tokenizer(runs["bytes"], tokenizer=runs["copy"])


# ---- minifloat generate ---------------------------------------------------------------------------------------------


def _expected(run: pathlib.Path, tok) -> tuple[list[int], str]:
    """The prompt's ids and the continuation the command should print: the CLI's bf16 greedy path by hand."""
    prompt = tok.encode(PROMPT)
    model = load_run_model(run, device="cpu").to(torch.bfloat16)
    out = generate(model, prompt, max_new_tokens=NEW_TOKENS)
    return prompt, printable(tok.decode(out.tokens[0]))


@pytest.mark.parametrize("kind", ["shards", "text"])
def test_generate_encodes_and_decodes_with_the_runs_tokenizer(runs, capsys, kind):
    tok = run_tokenizer(runs[kind])
    prompt, continuation = _expected(runs[kind], tok)
    assert prompt != list(PROMPT.encode()) and len(prompt) < len(PROMPT)  # BPE ids, not bytes
    status, out, err = _cli(capsys, "generate", "--run", str(runs[kind]), "--prompt", PROMPT, "--max-new-tokens",
                            str(NEW_TOKENS), "--device", "cpu")
    assert status == 0 and out == continuation + "\n", (out, continuation)
    assert err.count("\n") == 1 and f"1×{NEW_TOKENS} tokens after a {len(prompt)}-token prompt" in err, err


def test_generate_on_a_byte_run_reads_bytes(runs, capsys):
    prompt, continuation = _expected(runs["bytes"], ByteTokenizer())
    status, out, err = _cli(capsys, "generate", "--run", str(runs["bytes"]), "--prompt", PROMPT, "--max-new-tokens",
                            str(NEW_TOKENS), "--device", "cpu")
    assert status == 0 and out == continuation + "\n"
    assert f"after a {len(PROMPT)}-token prompt" in err


def test_shards_without_a_tokenizer_need_one(runs, capsys):
    run = str(runs["bins-run"])
    _one_error_line(*_cli(capsys, "generate", "--run", run, "--prompt", PROMPT),
                    [run, f"{VOCAB} token ids", "not recorded", "--tokenizer FILE"])
    status, out, err = _cli(capsys, "generate", "--run", run, "--prompt", PROMPT, "--tokenizer", str(runs["copy"]),
                            "--max-new-tokens", "3", "--device", "cpu")
    assert status == 0 and err.count("\n") == 1, err  # the run recorded no SHA-256: no warning


def test_a_tokenizer_of_another_vocabulary_is_refused(runs, capsys):
    other = runs["files"] / "other.json"
    train_bpe(["the model trains on tokens"] * 8, vocab_size=280).save(str(other))
    size = load_tokenizer(other).vocab_size
    for run in ("bins-run", "shards"):
        _one_error_line(*_cli(capsys, "generate", "--run", str(runs[run]), "--prompt", PROMPT, "--tokenizer",
                              str(other)),
                        [str(other), f"vocabulary of {size} ids", f"trained on {VOCAB}"])


def test_a_missing_or_changed_tokenizer_is_one_line_and_an_explicit_one_is_used_with_a_warning(runs, capsys,
                                                                                                 tmp_path):
    """A run whose checkpoint keeps a copy needs its --tokenizer file no more; one from before (the copy removed
    here) reads the file it recorded, refused with one line when that is missing or changed."""
    copy, old = runs["copy"], tmp_path / "old-run"
    shutil.copytree(runs["text"], old)
    (old / "ckpt" / "tokenizer.json").unlink()
    run = str(old)
    moved = copy.with_name("moved.json")
    copy.rename(moved)
    try:
        status, out, err = _cli(capsys, "generate", "--run", str(runs["text"]), "--prompt", PROMPT,
                                "--max-new-tokens", "3", "--device", "cpu")
        assert status == 0 and out and err.count("\n") == 1, err  # its checkpoint's copy
        _one_error_line(*_cli(capsys, "generate", "--run", run, "--prompt", PROMPT),
                        [run, str(copy), "missing", "--tokenizer FILE"])
        # the same tokenizer saved with other bytes: another SHA-256, the same ids
        copy.write_text(json.dumps(json.loads(moved.read_text(encoding="utf-8")), indent=1), encoding="utf-8")
        _one_error_line(*_cli(capsys, "generate", "--run", run, "--prompt", PROMPT),
                        [run, "changed since", "SHA-256", "--tokenizer FILE"])
        status, out, err = _cli(capsys, "generate", "--run", run, "--prompt", PROMPT, "--tokenizer", str(copy),
                                "--max-new-tokens", "3", "--device", "cpu")
        assert status == 0 and out, err
        warning, stats = err.splitlines()
        assert "is not the file run" in warning and "tok/s" in stats
    finally:
        copy.unlink(missing_ok=True)
        moved.rename(copy)


# ---- minifloat export -----------------------------------------------------------------------------------------------


def test_export_copies_the_runs_tokenizer_for_transformers(runs, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out = export_hf(runs["shards"], tmp_path / "hf")
    assert (out / "tokenizer.json").read_bytes() == (runs["tok"] / "tokenizer.json").read_bytes()
    ids = run_tokenizer(runs["shards"]).encode(PROMPT)
    assert PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json")).encode(PROMPT) == ids
    auto = AutoTokenizer.from_pretrained(str(out))
    assert auto.encode(PROMPT) == ids and auto.decode(ids) == PROMPT  # no BOS added, though bos_token is set


def test_export_of_a_token_run_names_its_end_of_text_as_eos_and_bos(runs, tmp_path):
    """The id training put after every file stops generation (eos) and starts it (bos), in both json files, as
    transformers reads them; a byte run has none."""
    from transformers import AutoTokenizer, GenerationConfig

    eot = load_tokenizer(runs["tok"] / "tokenizer.json").eot_id
    assert eot is not None
    for kind in ("shards", "text"):
        out = export_hf(runs[kind], tmp_path / kind)
        for name in ("config.json", "generation_config.json"):
            written = json.loads((out / name).read_text())
            assert (written["eos_token_id"], written["bos_token_id"], written["pad_token_id"]) == (eot, eot, None)
        generation = GenerationConfig.from_pretrained(str(out))
        assert generation.eos_token_id == generation.bos_token_id == eot
        auto = AutoTokenizer.from_pretrained(str(out))
        assert auto.eos_token == auto.bos_token == "<|endoftext|>" and auto.eos_token_id == eot
    out = export_hf(runs["bytes"], tmp_path / "bytes")
    for name in ("config.json", "generation_config.json"):
        written = json.loads((out / name).read_text())
        assert written["eos_token_id"] is written["bos_token_id"] is written["pad_token_id"] is None
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id is None


def test_export_of_a_byte_run_or_shards_without_a_tokenizer_has_no_tokenizer_file(runs, tmp_path, caplog):
    assert not (export_hf(runs["bytes"], tmp_path / "bytes") / "tokenizer.json").exists()
    with caplog.at_level("WARNING", logger="minifloat"):
        bare = export_hf(runs["bins-run"], tmp_path / "bare")
    assert not (bare / "tokenizer.json").exists()
    assert any("has no tokenizer.json" in r.getMessage() and "--tokenizer" in r.getMessage() for r in caplog.records)
    given = export_hf(runs["bins-run"], tmp_path / "given", tokenizer=runs["copy"])
    assert (given / "tokenizer.json").read_bytes() == runs["copy"].read_bytes()
