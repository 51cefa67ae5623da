"""`minifloat formats`, `minifloat demo` and `minifloat audit`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import pathlib
from collections.abc import Iterator

from rich.table import Table

from minifloat.cli import common
from minifloat.core.files import write_json
from minifloat.core.validate import check_choice, check_int, check_seed

AUDIT_BYTES = 100_000  # corpus bytes the audited batch is drawn from
AUDIT_SEQ_LEN = 64  # bytes per sequence of the audited Llama batch (TrainConfig's default seq_len)


def cmd_formats(args: argparse.Namespace) -> int:
    """Print the number-format table (every limit derived from the bit layout). With --gemms, the path each
    recipe's GEMMs take on a device instead: native on its tensor cores (and what shapes that needs) or emulated
    exactly (and why)."""
    from minifloat.numerics.formats import FORMATS

    if args.gemms:
        return _print_gemm_paths(args)
    if args.device:
        raise common.CliError("--device chooses the device of --gemms; add --gemms (the formats are the same anywhere)")
    rows = [f.describe() for f in FORMATS.values()]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    t = Table(title="minifloat number formats")
    for col in ("name", "bits", "E", "M", "bias", "max", "min normal", "min subnormal", "inf", "NaN", "torch dtype"):
        t.add_column(col, justify="right" if col not in ("name", "torch dtype") else "left")
    for r in rows:
        t.add_row(r["name"], str(r["bits"]), str(r["exponent_bits"]), str(r["mantissa_bits"]), str(r["bias"]),
                  f"{r['max']:.6g}", f"{r['min_normal']:.6g}",
                  "-" if r["min_subnormal"] is None else f"{r['min_subnormal']:.6g}",  # E8M0 has none
                  "yes" if r["has_inf"] else "no", "yes" if r["has_nan"] else "no", r["torch_dtype"] or "-")
    common.print_table(t)
    return 0


def _print_gemm_paths(args: argparse.Namespace) -> int:
    import torch

    from minifloat.fp8.paths import gemm_paths

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise common.CliError(f"--device {name}: not a torch device; use cpu, cuda or cuda:N") from None
    rows = gemm_paths(device)
    if args.json:
        print(json.dumps({"device": str(device), "gemms": [dataclasses.asdict(r) for r in rows]}, indent=1))
        return 0
    gpu = (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" and torch.cuda.is_available()
           else "")
    t = Table(title=f"GEMM paths on {device}{gpu}")
    for col in ("recipe", "GEMMs", "path", "why"):
        t.add_column(col)
    for r in rows:
        t.add_row(r.recipe, r.gemms, r.path, r.why)
    common.print_table(t)
    return 0


@contextlib.contextmanager
def _invalid_option() -> Iterator[None]:
    """Turn the ValueError of a validator (it names the field, which is the option's name) into the command's one
    error line, "invalid option: ...", before any work starts."""
    try:
        yield
    except ValueError as err:
        raise common.CliError(f"invalid option: {err}") from None


def _create_folder(flag: str, value: str, folder: pathlib.Path) -> None:
    """Create the folder an option's output goes to now, not after the work; a CliError naming the option if it
    cannot be."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise common.CliError(f"{flag} {value}: cannot create the folder {folder} ({err.strerror or err})") from None


DEMO_FILE = "demo.json"


def _finite_or_null(obj):
    """`obj` (dicts, lists, numbers) with every non-finite float as None."""
    if isinstance(obj, dict):
        return {k: _finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_null(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def _cell(value: float, spec: str) -> str:
    """A table cell: "-" for nan (no bf16 run to compare with, no FP8 cast), else the value formatted by `spec`."""
    return "-" if math.isnan(value) else format(value, spec)


def cmd_demo(args: argparse.Namespace) -> int:
    """Train one small byte-level MLP LM under fp32, bf16 and every FP8 recipe; print a comparison table.
    Shows a progress bar on a terminal, one line per variant as it starts and finishes otherwise (a log)."""
    from rich.progress import Progress

    from minifloat.training.demo import FINAL_LOSS_STEPS, VARIANTS, DemoConfig, DemoResult, run_demo

    variants = tuple(v.strip() for v in args.variants.split(",")) if args.variants is not None else VARIANTS
    with _invalid_option():
        config = DemoConfig(steps=args.steps, batch=args.batch, seed=args.seed, variants=variants)
    out = pathlib.Path(args.out) if args.out is not None else None
    if out is not None:
        if (out / DEMO_FILE).exists() and not args.overwrite:  # refused before the work, never overwritten
            raise common.CliError(f"--out {args.out} already holds {DEMO_FILE}; choose another --out, or pass "
                                  f"--overwrite to replace it")
        _create_folder("--out", args.out, out)
    console = common.console
    log_lines = not console.is_terminal  # rich draws no live bar there: the variants' lines show the progress

    with Progress(console=console, transient=True, disable=log_lines) as bar:
        task = bar.add_task("", total=config.steps * len(config.variants))

        def progress(variant: str, done: int) -> None:
            if done:
                bar.advance(task)
                return
            bar.update(task, description=variant)
            if log_lines:
                console.print(f"{variant}: training {config.steps} steps", highlight=False)

        def on_result(r: DemoResult) -> None:
            console.print(f"{r.variant}: final loss {r.final_loss:.4f}, {r.ms_per_step:.1f} ms/step", highlight=False)

        results, curves = run_demo(config, progress=progress, on_result=on_result)
    t = Table(title=f"byte-level MLP on Python stdlib sources, {config.steps} steps, batch {config.batch}, "
                    f"seed {config.seed}")
    t.add_column("variant", no_wrap=True)
    for col in ("final loss", "vs bf16", "ms/step", "min SQNR dB", "max saturated"):
        t.add_column(col, justify="right")
    for r in results:
        t.add_row(r.variant, _cell(r.final_loss, ".4f"), _cell(r.rel_diff_vs_bf16, "+.2%"),
                  _cell(r.ms_per_step, ".1f"), _cell(r.min_sqnr_db, ".1f"), _cell(r.max_saturated, ".2%"))
    common.print_table(t)
    last = min(FINAL_LOSS_STEPS, config.steps)
    console.print(f"final loss = mean of the last {last} step{'s' * (last > 1)}' training loss; SQNR and saturation "
                  f"over every FP8 cast of the last step (see minifloat.fp8.telemetry).")
    if out is not None:
        # nan (no bf16 run to compare with, no FP8 cast, a diverged loss) is null: JSON has no NaN
        write_json(out / DEMO_FILE, _finite_or_null({"results": [r.__dict__ for r in results], "curves": curves}),
                   atomic=True)
        console.print(f"wrote {out / DEMO_FILE}")
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """Run one forward+backward of a model under a precision policy, recording the dtype every op ran in; flag
    violations of the policy (softmax or a norm below fp32, an FP8 embedding or head, a low-precision all-reduce).
    Exits with status 1 when there are violations (or, with --preflight, pre-flight issues)."""
    import torch

    from minifloat.safety.audit import audit
    from minifloat.safety.preflight import preflight
    from minifloat.training.demo import ByteMLP, stdlib_bytes
    from minifloat.amp.policy import PRESETS, PrecisionPolicy

    with _invalid_option():
        check_choice("preset", args.preset, sorted(PRESETS))
        check_int("batch", args.batch, low=1)
        check_seed("seed", args.seed)
    # checked before the work
    json_path = common.json_output(args)
    policy = PrecisionPolicy.preset(args.preset)
    torch.manual_seed(args.seed)
    if args.model == "byte-mlp":
        model = policy.apply(ByteMLP())
        data = stdlib_bytes(AUDIT_BYTES)
        g = torch.Generator().manual_seed(args.seed)
        start = torch.randint(0, data.numel() - model.context - 1, (args.batch,), generator=g)
        window = data[start[:, None] + torch.arange(model.context + 1)]
        inputs, targets = window[:, :-1], window[:, -1]

        def loss_fn(logits, _inputs):
            return torch.nn.functional.cross_entropy(logits.float(), targets)
    else:  # the reference Llama: model(x, y) -> (logits, loss)
        from minifloat.training.data import BatchLoader, ByteCorpus, DataConfig
        from minifloat.training.model import Llama, LlamaConfig

        config = LlamaConfig.preset(args.model)
        model = policy.apply(Llama(config))
        corpus = ByteCorpus.load(DataConfig(max_bytes=AUDIT_BYTES))
        seq_len = min(AUDIT_SEQ_LEN, config.max_seq_len)
        inputs = next(BatchLoader(corpus.train, batch_size=args.batch, seq_len=seq_len, seed=args.seed))  # (x, y)

        def loss_fn(output, _batch):
            return output[1]  # the model's fp32 cross-entropy

    with policy.autocast("cpu"):
        report = audit(model, inputs, loss_fn=loss_fn)
    common.print_table(policy.describe(model))
    common.print_table(report.table(full=args.full))
    for v in report.violations:
        common.console.print(f"[red]violation[/red] {v.rule}: {v.module} ({v.phase}) {v.op} in {v.precision} — "
                             f"{v.detail}")
    common.console.print("audit passed: no policy violations" if report.ok else
                         f"[red]audit failed: {len(report.violations)} violation(s)")
    status, pre = 0 if report.ok else 1, None
    if args.preflight:
        pre = preflight(model, inputs)
        common.print_table(pre.table())
        status = status or (0 if pre.fp16_safe else 1)
    if json_path is not None:  # with --preflight, its findings beside the audit's
        found = json.loads(report.to_json()) | ({"preflight": json.loads(pre.to_json())} if pre is not None else {})
        json_path.write_text(json.dumps(found, indent=1))
        common.console.print(f"wrote {json_path}")
    return status


FORMATS_HELP = "print the number-format table"
DEMO_HELP = "FP8 vs BF16 vs FP32 on a small byte-level MLP (minutes on 2 CPU cores)"
AUDIT_HELP = "record the dtype every op of a model runs in and flag policy violations"


def add_formats(sub) -> None:
    f = sub.add_parser("formats", help=FORMATS_HELP, description=cmd_formats.__doc__)
    f.add_argument("--json", action="store_true", help="print JSON instead of a table")
    f.add_argument("--gemms", action="store_true",
                   help="print which GEMM path each recipe takes on --device (native or emulated, and why)")
    f.add_argument("--device", default="", help="device for --gemms (default: cuda when torch sees a GPU, else cpu)")
    f.set_defaults(func=cmd_formats)


def add_demo(sub) -> None:
    d = sub.add_parser("demo", help=DEMO_HELP, description=cmd_demo.__doc__)
    d.add_argument("--steps", type=int, default=300, help="training steps per variant (default 300)")
    d.add_argument("--batch", type=int, default=256, help="sequences per batch (default 256)")
    d.add_argument("--seed", type=int, default=0, help="seed for weights and batch order (default 0)")
    d.add_argument("--variants", default=None, help="comma list of variants (default: all)")
    d.add_argument("--out", default=None, type=common.path_arg, help="folder to write demo.json with results and loss curves (an existing "
                                             "demo.json there is refused unless --overwrite)")
    d.add_argument("--overwrite", action="store_true", help="replace demo.json in --out")
    d.set_defaults(func=cmd_demo)


def add_audit(sub) -> None:
    from minifloat.amp.policy import PRESETS
    from minifloat.training.model import SIZES

    a = sub.add_parser("audit", help=AUDIT_HELP, description=cmd_audit.__doc__)
    a.add_argument("--model", default="byte-mlp", choices=["byte-mlp", *SIZES],
                   help=f"model to audit: byte-mlp (the demo's model) or a reference Llama size ({', '.join(SIZES)}) "
                        f"on a batch of {AUDIT_SEQ_LEN}-byte sequences (default byte-mlp)")
    a.add_argument("--preset", default="fp8-delayed",
                   help=f"precision policy preset: {', '.join(PRESETS)} (default fp8-delayed)")
    a.add_argument("--batch", type=int, default=32, help="sequences in the audited batch (default 32)")
    a.add_argument("--seed", type=int, default=0, help="seed for weights and batch (default 0)")
    a.add_argument("--preflight", action="store_true",
                   help="also check FP16 overflow/underflow of weights and activations, and native BF16 support")
    a.add_argument("--full", action="store_true", help="list every recorded op, not only the summary rows")
    a.add_argument("--json", default=None, metavar="PATH",
                   help="write every recorded op and violation as JSON to PATH (a new file in an existing folder, "
                        "or --overwrite)")
    a.add_argument("--overwrite", action="store_true", help="replace the file --json names if it exists")
    a.set_defaults(func=cmd_audit)
