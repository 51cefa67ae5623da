"""A long text is encoded in pieces with the ids of the text encoded whole (minifloat.training.tokenizer.text_pieces).

A single large file (TinyStories' 2 GB train.txt, a dump of a wiki) would otherwise be encoded in one call, and
tokenizers holds some 100-250 bytes a token while it encodes: tens of GB. Cuts are taken only where encoding the
two sides apart gives the ids of encoding them together; these tests hold that to the whole-text encoding for three
kinds of pre-tokenizer (GPT-2's byte-level regex, Llama 3's regex, SentencePiece's Metaspace, which marks the start
of its input) and for special tokens written in the text.
"""

from __future__ import annotations

import pathlib
import sysconfig

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from minifloat.training import tokenizer as tokenizer_module
from minifloat.training.tokenizer import BPE_SPECIAL, encode_batches, load_tokenizer, text_pieces, train_bpe

EOT = "<|endoftext|>"
# Llama 3's pre-tokenizer pattern (tiktoken's cl100k form): punctuation takes the line breaks after it along
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _corpus() -> str:
    """About 300k characters of Python sources with the end-of-text token written into the text at places."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8") for p in sorted(root.glob("[a-c]*.py"))[:12]]
    return f"\n{EOT}\n".join(texts) + f" {EOT}{EOT}  \n\n 12345678901234567890\t\t\n"


CORPUS = _corpus()


def _train(pre_tokenizer, decoder, alphabet) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=[EOT], show_progress=False, initial_alphabet=alphabet)
    tok.train_from_iterator([CORPUS[:100_000]], trainer)
    return tok


def _tokenizers() -> dict[str, Tokenizer]:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    llama3 = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    return {"gpt2": _train(byte_level, decoders.ByteLevel(), pre_tokenizers.ByteLevel.alphabet()),
            "llama3": _train(llama3, decoders.ByteLevel(), pre_tokenizers.ByteLevel.alphabet()),
            "metaspace": _train(metaspace, decoders.Metaspace(replacement="▁", prepend_scheme="first"), [])}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for name, tok in _tokenizers().items():
        tok.save(str(folder / f"{name}.json"))
        out[name] = load_tokenizer(folder / f"{name}.json")
    return out


def _ids(tok, text: str) -> list[int]:
    return tok.tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("name", ["gpt2", "llama3", "metaspace"])
@pytest.mark.parametrize("piece_chars", [1, 40, 3000, 50_000])
def test_pieces_encode_to_the_whole_texts_ids(loaded, name, piece_chars):
    tok = loaded[name]
    pieces = list(text_pieces(tok, CORPUS, piece_chars))
    assert "".join(pieces) == CORPUS and all(pieces)
    assert [i for piece in pieces for i in _ids(tok, piece)] == _ids(tok, CORPUS)
    if name != "metaspace" and piece_chars >= 3000:  # regex pre-tokenizers: a break is found in every piece's half
        assert len(pieces) >= len(CORPUS) // piece_chars and max(map(len, pieces)) <= piece_chars


@pytest.mark.parametrize("piece_chars", [3000, 50_000])  # 50k: more failing line breaks per piece than CUT_TRIES
def test_a_tokenizer_that_marks_each_inputs_start_is_cut_only_before_a_space(loaded, piece_chars):
    """Metaspace with prepend_scheme="first" puts "▁" before its input unless the input starts with a space (which
    it turns into "▁"): a cut before a line break would add a "▁", so the check takes only the cuts before spaces."""
    pieces = list(text_pieces(loaded["metaspace"], CORPUS, piece_chars))
    assert len(pieces) >= len(CORPUS) // piece_chars and all(piece.startswith(" ") for piece in pieces[1:])
    assert any(piece.startswith("\n") for piece in text_pieces(loaded["gpt2"], CORPUS, piece_chars))


def test_a_tokenizer_without_a_pre_tokenizer_is_never_cut(tmp_path):
    """Llama 2's tokenizer.json form: a normalizer that prepends "▁" to the input and no pre-tokenizer, so the BPE
    sees the whole input as one word and every cut changes the ids: the text stays one piece."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.train_from_iterator([CORPUS[:4000]], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    tok.save(str(tmp_path / "llama2.json"))
    loaded_tok, text = load_tokenizer(tmp_path / "llama2.json"), CORPUS[:20_000]
    assert list(text_pieces(loaded_tok, text, 3000)) == [text]


def test_a_cut_through_a_special_token_is_refused(loaded):
    """The only break in reach lies inside a special token ("<|end oftext|>" is not one): no cut."""
    tok = loaded["gpt2"]
    text = "x" * 500 + "<|end oftext|>" + "y" * 500
    assert _ids(tok, text) == [i for piece in text_pieces(tok, text, 600) for i in _ids(tok, piece)]
    spaced = "ab " * 100 + EOT + " cd" * 100
    pieces = list(text_pieces(tok, spaced, 320))
    assert len(pieces) > 1 and [i for p in pieces for i in _ids(tok, p)] == _ids(tok, spaced)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.sampled_from(["a", "bb", "ccc", "123", "4567", ".", ",\n", "\n", "\n\n", " ", "   ", "\t",
                                       EOT, "é", "字", "'s", "!!", "\r\n"]), min_size=1, max_size=400),
       piece_chars=st.integers(1, 200), name=st.sampled_from(["gpt2", "llama3", "metaspace"]))
def test_pieces_of_random_texts_keep_their_ids(loaded, words, piece_chars, name):
    tok, text = loaded[name], "".join(words)
    pieces = list(text_pieces(tok, text, piece_chars))
    assert "".join(pieces) == text
    assert [i for piece in pieces for i in _ids(tok, piece)] == _ids(tok, text)


def test_a_long_text_is_encoded_a_piece_at_a_time(loaded, monkeypatch):
    """encode_batches hands tokenizers at most batch_chars characters at a time (one piece of a long text; the
    end-of-text id after its last piece only) and yields the ids of the texts encoded whole."""
    tok, calls = loaded["gpt2"], []
    encode = tokenizer_module._encode

    def spy(loaded_tok, texts, ends):
        calls.append(sum(map(len, texts)))
        return encode(loaded_tok, texts, ends)

    monkeypatch.setattr(tokenizer_module, "_encode", spy)
    texts = [CORPUS, "short", CORPUS[:7000]]
    got = torch.cat(list(encode_batches(tok, iter(texts), batch_chars=4096)))
    expected = [i for text in texts for i in [*_ids(tok, text), tok.eot_id]]
    assert got.tolist() == expected
    assert len(calls) > len(CORPUS) // 4096 and max(calls) <= 4096


def test_the_bpe_trained_on_pieces_is_the_one_trained_on_the_whole_texts(monkeypatch):
    """train_bpe hands the trainer a long text in pieces (tokenizers holds all the words of one input at once: 4.5 GiB
    for one 50 MB file) cut where the byte-level pre-tokens stay the same, so the counts, merges and tokenizer.json
    are those of the texts given whole."""
    texts = [CORPUS, CORPUS[:5000]]
    whole = Tokenizer(models.BPE())
    whole.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    whole.decoder = decoders.ByteLevel()
    whole.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=[BPE_SPECIAL],
                                                         show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cuts = []
    pieces = tokenizer_module._pieces

    def spy(text, piece_chars, split):
        for piece in pieces(text, piece_chars, split):
            cuts.append(len(piece))
            yield piece

    monkeypatch.setattr(tokenizer_module, "ENCODE_CHARS", 4000)
    monkeypatch.setattr(tokenizer_module, "_pieces", spy)
    assert train_bpe(iter(texts), vocab_size=600).to_str() == whole.to_str()
    assert len(cuts) > len(CORPUS) // 4000 and max(cuts) <= 4000
