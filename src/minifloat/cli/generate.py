"""`minifloat generate`: continue a prompt with a trained run's model."""

from __future__ import annotations

import argparse
import math
import unicodedata

from rich.text import Text

from minifloat.cli import common

MIB = 2 ** 20
DEFAULT_NEW_TOKENS = 128  # without --max-new-tokens: this many, or as many as the model's context leaves


def _parse(flag: str, text: str | None, kind: type):
    """An option's number, parsed here (not by argparse, whose error is a usage block) so that a bad value is the
    command's one error line."""
    if text is None:
        return None
    try:
        return kind(text)
    except ValueError:
        raise common.CliError(f"invalid option: {flag} must be {'an int' if kind is int else 'a number'}, "
                              f"got {text!r}") from None


def printable(text: str) -> str:
    """`text` with control characters other than newline and tab shown as U+FFFD: a model's bytes must not drive
    the terminal (escape sequences, carriage returns)."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else "\ufffd" for c in text)


def summary(stats) -> str:
    """The one stats line: tokens, prefill and decode rates, peak memory and where that figure comes from."""
    from minifloat.inference.generate import HELD_TENSORS

    decode = stats.decode_tokens_per_s
    rss = stats.rss_peak_delta_bytes
    source = f"{stats.peak_memory_source}" + (f"; process peak RSS +{rss / MIB:.1f} MiB" if rss is not None
                                              and stats.peak_memory_source == HELD_TENSORS else "")
    return (f"{stats.batch}×{stats.new_tokens} tokens after a {stats.prompt_tokens}-token prompt · prefill "
            f"{stats.prefill_tokens_per_s:.0f} tok/s · decode {'-' if math.isnan(decode) else f'{decode:.1f}'} tok/s "
            f"· peak memory {stats.peak_memory_bytes / MIB:.1f} MiB ({source}) · KV cache {stats.kv_cache} "
            f"{stats.kv_cache_bytes / MIB:.2f} MiB")


def cmd_generate(args: argparse.Namespace) -> int:
    """Load a run's model (its latest checkpoint, or --checkpoint) on the run's device (or --device), in bf16 or
    FP8 (--fp8), continue the prompt and print the continuation, then one stats line on stderr (tokens/s, peak
    memory). --hf DIR instead loads a Hugging Face model folder (its own class and dtype; FP8 weights with --fp8)
    and continues the prompt with transformers' generate, encoded by the folder's tokenizer (no chat template),
    stopping early at its end-of-sequence token. Greedy unless --temperature > 0. Text is encoded and decoded by the run's tokenizer: the one it trained
    with (train --tokenizer, or the tokenizer.json of a minifloat tokenize folder), read from the copy its checkpoint
    keeps, so any working folder will do; else --tokenizer (.bin shards without one need it); a run on text without
    a tokenizer reads UTF-8 bytes (invalid sequences print as U+FFFD).
    Exits with status 2 on a bad option, run folder, checkpoint or tokenizer (missing, or of another vocabulary
    size than the run's)."""
    import torch

    from minifloat.inference.generate import FP8_RECIPES, check_sampling, generate, load_run_model
    from minifloat.inference.prepare import prepare_inference
    from minifloat.inference.tokenizer import run_tokenizer

    max_new_tokens = _parse("--max-new-tokens", args.max_new_tokens, int)
    temperature = _parse("--temperature", args.temperature, float)
    top_k = _parse("--top-k", args.top_k, int)
    seed = _parse("--seed", args.seed, int)
    if not args.prompt:
        raise common.CliError("invalid option: --prompt must be non-empty text")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (Python keeps them as surrogates)
        raise common.CliError("invalid option: --prompt is not UTF-8 text (bytes in another encoding); give the "
                              "prompt as UTF-8") from None
    if (args.run is None) == (args.hf is None):
        raise common.CliError("invalid option: name one model, --run DIR (a run of minifloat train) or --hf DIR (a "
                              "Hugging Face model folder)")
    if args.fp8 is not None and args.fp8 not in FP8_RECIPES:
        raise common.CliError(f"invalid option: --fp8 must be one of {', '.join(FP8_RECIPES)}, got {args.fp8!r}")
    if args.hf is not None:
        return _generate_pretrained(args, max_new_tokens, temperature, top_k, seed)
    tokenizer = run_tokenizer(args.run, args.checkpoint, tokenizer=args.tokenizer)  # the run's vocabulary
    try:  # before the model loads; generate() checks them again against the model
        check_sampling(max_new_tokens=1 if max_new_tokens is None else max_new_tokens, temperature=temperature,
                       top_k=top_k, seed=seed, kv_cache=args.kv_cache, vocab_size=tokenizer.vocab_size)
    except ValueError as err:
        raise common.CliError(f"invalid option: {err}") from None
    model = load_run_model(args.run, checkpoint=args.checkpoint, device=args.device)  # fp32
    if args.fp8 is not None:  # quantized from the fp32 weights: one rounding, not bf16's and then FP8's
        model = prepare_inference(model, recipe=FP8_RECIPES[args.fp8])
    model = model.to(torch.bfloat16)  # everything else in bf16; FP8 weight buffers keep their storage dtype
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise common.CliError(f"invalid option: --prompt {args.prompt!r} encodes to no tokens")
    if max_new_tokens is None:  # the positions left after the prompt (the last new token takes none), at least 1
        max_new_tokens = max(1, min(DEFAULT_NEW_TOKENS, model.config.max_seq_len - len(prompt) + 1))
    out = generate(model, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                   kv_cache=args.kv_cache)
    common.console.print(Text(printable(tokenizer.decode(out.tokens[0]))), soft_wrap=True, highlight=False)
    common.ERR.print(summary(out.stats), soft_wrap=True, highlight=False, markup=False)
    return 0


def _generate_pretrained(args: argparse.Namespace, max_new_tokens, temperature, top_k, seed) -> int:
    """--hf DIR: the folder's model (its dtype, or FP8 weights with --fp8) continues the prompt with transformers'
    generate (minifloat.inference.hf_generate)."""
    from minifloat.inference.hf_generate import generate_pretrained, load_generator

    refused = [flag for flag, given in (("--tokenizer", args.tokenizer), ("--checkpoint", args.checkpoint != "latest"),
                                        ("--kv-cache", args.kv_cache != "bf16")) if given]
    if refused:
        raise common.CliError(f"invalid option: {refused[0]} is for --run; with --hf the folder's own tokenizer and "
                              f"transformers' KV cache (in the model's dtype) are used")
    if max_new_tokens is None:
        max_new_tokens = DEFAULT_NEW_TOKENS
    try:  # (a Hub id is looked up in the local Hugging Face cache: hf_models.model_folder)
        model, tokenizer = load_generator(args.hf, fp8=args.fp8, device=args.device or "auto")
        out = generate_pretrained(model, tokenizer, args.prompt, max_new_tokens=max_new_tokens,
                                  temperature=temperature, top_k=top_k, seed=seed)
    except ValueError as err:
        raise common.CliError(str(err)) from None
    common.console.print(Text(printable(out.text)), soft_wrap=True, highlight=False)
    common.ERR.print(summary(out.stats), soft_wrap=True, highlight=False, markup=False)
    return 0


HELP = "continue a prompt with a trained run's or a Hugging Face model (KV cache, bf16 or FP8)"  # its line in `minifloat --help`


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help=HELP, description=cmd_generate.__doc__)
    model = g.add_argument_group("model (one of)")
    model.add_argument("--run", default=None, metavar="DIR", help="the run's folder (minifloat train --out DIR)")
    model.add_argument("--hf", default=None, metavar="DIR", type=common.path_arg,
                       help="a Hugging Face model folder (config.json, weights, tokenizer), or a Hub id "
                            "owner/name in the local Hugging Face cache (nothing is downloaded): generated with "
                            "transformers' generate and KV cache, in the folder's dtype or with --fp8 weights")
    g.add_argument("--prompt", required=True,
                   help="the text to continue (encoded by the run's tokenizer; UTF-8 bytes for a run on text without "
                        "one)")
    g.add_argument("--max-new-tokens", default=None, metavar="N",
                   help=f"tokens to generate (bytes for a run on text without a tokenizer; default "
                        f"{DEFAULT_NEW_TOKENS}, or fewer where the model's max_seq_len leaves fewer after the prompt)")
    g.add_argument("--temperature", default="0", metavar="T", help="0 for greedy (default), else the softmax "
                                                                   "temperature")
    g.add_argument("--top-k", default=None, metavar="K", help="sample among the K most likely tokens only")
    g.add_argument("--seed", default="0", metavar="S", help="seed of the sampling (default 0)")
    g.add_argument("--kv-cache", default="bf16", metavar="DTYPE",
                   help="storage of the KV cache: bf16 (default), fp8 (E4M3, a scale per token and head) or fp32")
    g.add_argument("--fp8", default=None, metavar="RECIPE",
                   help="FP8 weights by minifloat.inference.prepare_inference, scaled per tensor, row, 128×128 "
                        "block or MX block: tensor, row, block or mx (default: bf16 weights)")
    g.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="the tokenizer.json to encode and decode with, for a run that records none (.bin shards "
                        "without meta.json) or whose file moved; refused unless its vocabulary size is the run's; "
                        "a file other than the one the run recorded (SHA-256) is used with a warning")
    g.add_argument("--checkpoint", default="latest", metavar="NAME",
                   help="latest (the run's ckpt/, default), or a checkpoint folder inside the run or elsewhere")
    g.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the device the run used)")
    g.set_defaults(func=cmd_generate)
