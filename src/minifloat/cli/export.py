"""`minifloat export`: a run's model as a Hugging Face checkpoint (bf16, or FP8 as vLLM / DeepSeek-V3 store it)."""

from __future__ import annotations

import argparse
import json
import pathlib

from minifloat.cli import common

FORMATS = ("hf", "hf-fp8", "hf-fp8-block")  # minifloat.inference.hf.FORMATS (checked against it in tests)
DTYPES = ("bfloat16", "float16", "float32")
ACTIVATIONS = ("auto", "static", "dynamic")


def _choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    """Checked here, not by argparse, whose error is a usage block: a bad value is the command's one error line."""
    if value not in choices:
        raise common.CliError(f"invalid option: {flag} must be one of {', '.join(choices)}, got {value!r}")


def cmd_export(args: argparse.Namespace) -> int:
    """Write a run's model (its latest checkpoint, or --checkpoint) as a Hugging Face checkpoint in --out:
    config.json, generation_config.json and model.safetensors with LlamaForCausalLM's tensor names
    (Qwen3ForCausalLM's for a QK-norm model). --format hf stores plain --dtype tensors (transformers'
    from_pretrained reads them); hf-fp8 stores each quantized linear as float8_e4m3fn with one fp32 weight_scale
    (vLLM's / AutoFP8's "fp8" layout) and, when the run trained with delayed scaling or --calibrate N is given
    (its first N validation batches), a static input_scale;
    hf-fp8-block stores DeepSeek-V3's 128×128 blocks with fp32 weight_scale_inv. Embeddings, norms, lm_head and the
    layers training kept in high precision stay --dtype. transformers (5.24, CPU) reads hf, and hf-fp8-block whose
    sizes are multiples of 128 (or at most 128), right, and refuses hf-fp8 in one line (it would read its weights
    unscaled): for transformers export hf or hf-fp8-block; the command prints one warning line on stderr for a
    block file transformers would load wrong. A
    run trained with a tokenizer gets its tokenizer.json (as minifloat generate finds it, or --tokenizer) and a
    tokenizer_config.json, which AutoTokenizer reads (a warning line when a token run's tokenizer is not found),
    and its end-of-text id as eos_token_id and bos_token_id in both configs (null for a byte run). An
    --out that exists and is not empty is refused unless --overwrite, which replaces only an earlier export's files
    there; a folder holding a run or checkpoint is always refused. --hf DIR instead exports a Hugging Face model
    folder (any architecture transformers reads): its linears quantized with the format's recipe, under its own
    tensor names and config, its tokenizer files copied; without --calibrate it is read and written one
    safetensors file at a time (one output shard per input file, and the index), never loaded whole, where its
    stored tensors are what transformers would load (else it is loaded whole; -v says why). Exits with status 2 on a bad option, run folder, model
    folder or checkpoint."""
    from minifloat.inference.export import NeedsCalibration, check_activations, export_hf, run_calibration

    _choice("--format", args.format, FORMATS)
    _choice("--dtype", args.dtype, DTYPES)
    _choice("--activations", args.activations, ACTIVATIONS)
    if args.calibrate is not None and args.calibrate < 1:
        raise common.CliError(f"invalid option: --calibrate must be a number of batches >= 1, got {args.calibrate}")
    if (args.run is None) == (args.hf is None):
        raise common.CliError("invalid option: name one source, --run DIR (a run of minifloat train) or --hf DIR "
                              "(a Hugging Face model folder)")
    if args.hf is not None:
        return _export_pretrained(args)
    if args.data is not None:
        raise common.CliError("invalid option: --data is for --hf; a run calibrates on its own validation data "
                              "(--calibrate N)")
    calibration = None
    if args.calibrate is not None:
        # the library's rules, before the batches are read: --calibrate needs hf-fp8 and static or auto scales
        check_activations(args.format, args.activations, calibrated=True)
        calibration = run_calibration(args.run, args.calibrate, checkpoint=args.checkpoint)
        if len(calibration) < args.calibrate:  # the run's validation split is all there is to calibrate on
            common.console.print(f"note: --calibrate {args.calibrate}: the run's validation split holds "
                                 f"{len(calibration)} batch(es) of its shape; calibrating on those", highlight=False)
    try:
        out = export_hf(args.run, args.out, format=args.format, checkpoint=args.checkpoint, dtype=args.dtype,
                        activations=args.activations, calibration=calibration, tokenizer=args.tokenizer,
                        overwrite=args.overwrite)
    except NeedsCalibration:
        raise common.CliError("--activations static: the run's model carries no activation scales to export; "
                              "calibrate them with --calibrate N (batches of the run's validation data), or "
                              "export --activations dynamic") from None
    _report(out, args)
    return 0


def _export_pretrained(args: argparse.Namespace) -> int:
    """--hf DIR: the folder's model prepared for FP8 inference with the layout's recipe, exported beside its
    tokenizer files (minifloat.inference.hf_models)."""
    from minifloat.inference import hf_models
    from minifloat.inference.export import check_activations, export_hf
    from minifloat.inference.prepare import EXPORT_REPORTS_EXPERTS, prepare_inference

    refused = [flag for flag, given in (("--tokenizer", args.tokenizer), ("--checkpoint", args.checkpoint != "latest"))
               if given]
    if refused:
        raise common.CliError(f"invalid option: {refused[0]} is for --run; with --hf the folder's own tokenizer is "
                              f"copied")
    calibrate = args.calibrate is not None
    if calibrate != (args.data is not None):
        raise common.CliError("invalid option: with --hf, --calibrate N and --data DIR go together (N batches of "
                              "DIR's text, encoded with the folder's tokenizer.json)")
    check_activations(args.format, args.activations, calibrated=calibrate)
    if args.activations == "static" and not calibrate:
        raise common.CliError("invalid option: --activations static needs scales: with --hf, calibrate them "
                              "(--calibrate N --data DIR), or export --activations dynamic")
    args.hf = str(hf_models.model_folder(args.hf))  # a Hub id: its snapshot in the local Hugging Face cache
    if pathlib.Path(args.out).resolve() == pathlib.Path(args.hf).resolve():  # --overwrite would replace the model
        raise common.CliError(f"invalid option: --out {args.out} is the model folder --hf reads; choose another folder "
                              f"for the export")
    if not calibrate:  # shard by shard where it can be (minifloat.inference.hf_stream), else the whole model
        _report(_export_streamed(args), args)
        return 0
    model = hf_models.load_pretrained(args.hf)
    batches = hf_models.folder_calibration(args.hf, args.data, args.calibrate, model)
    with EXPORT_REPORTS_EXPERTS.on():
        model = prepare_inference(model, recipe=hf_models.FORMAT_RECIPES[args.format], calibration=batches,
                                  activations="static")
    out = export_hf(model, args.out, format=args.format, dtype=args.dtype, activations="static",
                    overwrite=args.overwrite, copy_files=hf_models.tokenizer_files(args.hf))
    _report(out, args)
    return 0


def _export_streamed(args: argparse.Namespace) -> pathlib.Path:
    """hf_stream.export_folder with a progress bar on a terminal (stderr), drawn from the first tensor on."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from minifloat.inference.hf_stream import export_folder

    bar = Progress(TextColumn("[bold]exporting tensors"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=common.ERR, transient=True, disable=not common.ERR.is_terminal)
    task = bar.add_task("export", total=None)

    def progress(done: int, total: int) -> None:
        if not bar.live.is_started:
            bar.start()
        bar.update(task, completed=done, total=total)

    try:
        return export_folder(args.hf, args.out, format=args.format, dtype=args.dtype, overwrite=args.overwrite,
                             progress=progress)
    finally:
        bar.stop()


def _report(out, args: argparse.Namespace) -> None:
    config = json.loads((pathlib.Path(out) / "config.json").read_text(encoding="utf-8"))
    quant = config.get("quantization_config")
    detail = config["architectures"][0]
    if quant is not None:
        kept = quant["ignored_layers"]
        detail += (f", {quant['activation_scheme']} activations, kept in {args.dtype}: "
                   f"{', '.join(kept) if kept else 'none'}")
    common.console.print(f"wrote {out} ({args.format}: {detail})", highlight=False, soft_wrap=True)


HELP = "write a run's model as a Hugging Face checkpoint (bf16 or FP8)"  # its line in `minifloat --help`


def add_parser(sub) -> None:
    e = sub.add_parser("export", help=HELP, description=cmd_export.__doc__)
    source = e.add_argument_group("source (one of)")
    source.add_argument("--run", default=None, metavar="DIR", help="the run's folder (minifloat train --out DIR)")
    source.add_argument("--hf", default=None, metavar="DIR", type=common.path_arg,
                        help="a Hugging Face model folder (config.json and weights, read with transformers), or "
                             "a Hub id owner/name in the local Hugging Face cache (nothing is downloaded): its "
                             "linears are quantized with the --format's recipe (hf-fp8: per tensor; hf-fp8-block: "
                             "128×128 blocks; first block's q/k/v and the head kept), its tokenizer files copied; "
                             "streamed one safetensors file at a time")
    e.add_argument("--format", default="hf", metavar="FORMAT",
                   help="hf (plain tensors), hf-fp8 (per-tensor FP8, vLLM's 'fp8'; transformers loads it wrong) or "
                        "hf-fp8-block (128×128 block FP8, DeepSeek-V3's; transformers reads it) (default hf)")
    e.add_argument("--out", required=True, metavar="DIR", type=common.path_arg, help="the export folder (new or empty, or --overwrite)")
    e.add_argument("--checkpoint", default="latest", metavar="NAME",
                   help="latest (the run's ckpt/, default), or a checkpoint folder inside the run or elsewhere")
    e.add_argument("--dtype", default="bfloat16", metavar="DTYPE",
                   help="dtype of the tensors that are not FP8: bfloat16 (default), float16 or float32")
    e.add_argument("--activations", default="auto", metavar="SCHEME",
                   help="hf-fp8's activation scales: static (the run's delayed input scales; an error without "
                        "them), dynamic, or auto (static when the run has them; default)")
    e.add_argument("--calibrate", type=int, default=None, metavar="N",
                   help="hf-fp8: static input scales from the run's first N validation batches (amax / 448 per "
                        "layer), for a run without delayed scales of its own (--hf: N batches of --data); refused "
                        "with --activations dynamic")
    e.add_argument("--data", default=None, metavar="DIR", type=common.path_arg,
                   help="--hf with --calibrate N: text (a folder of files, or token shards) to calibrate static "
                        "input scales on, encoded with the model folder's tokenizer.json (batches of 4 × 512 "
                        "tokens)")
    e.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="the tokenizer.json to copy into --out, for a run that records none (.bin shards without "
                        "meta.json) or whose file moved; refused unless its vocabulary size is the run's")
    e.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out once the new one is complete (other files there stay; "
                        "a run or checkpoint is never replaced)")
    e.set_defaults(func=cmd_export)
