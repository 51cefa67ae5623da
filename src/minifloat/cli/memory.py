"""`minifloat memory`: the bytes of one training step, measured, beside plain fp32 and bf16 AdamW."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from rich.table import Table

from minifloat.cli import common

if TYPE_CHECKING:
    from minifloat.training.memory import MemoryReport

MIB = 2 ** 20
# table rows: Footprint field -> label (minifloat.training.memory.KINDS says what each holds)
ROWS = {"weights": "weights", "master_weights": "master weights", "gradients": "gradients",
        "optimizer_state": "optimizer state", "fp8_scaling": "FP8 scaling", "buffers": "other buffers",
        "saved": "saved for backward", "total": "total"}


def cmd_memory(args: argparse.Namespace) -> int:
    """Build the model under a preset, take one real training step on the run's first batch, and print the bytes it
    holds by kind (weights, master weights, gradients, optimizer state, FP8 scaling state, other buffers, tensors
    saved for backward), each also per parameter, beside the same step in plain fp32 with AdamW and in bf16
    autocast with fp32 AdamW. Every figure is measured from live tensors, each storage counted once
    (minifloat.training.memory). Exits with status 2 on an invalid option."""
    from minifloat.training.config import TrainConfig
    from minifloat.training.memory import memory_report
    from minifloat.training.optimizer import MASTER_UPDATES

    if args.master not in MASTER_UPDATES:
        raise common.CliError(f"invalid option: --master must be one of {', '.join(MASTER_UPDATES)}; "
                              f"got {args.master!r}")
    config = TrainConfig(model=args.model, preset=args.preset, batch_size=args.batch_size, seq_len=args.seq_len,
                         seed=args.seed, data=args.data, max_bytes=args.max_bytes, tokenizer=args.tokenizer,
                         device=args.device,
                         optimizer_state=args.optimizer_state, master=args.master)
    # before the work
    json_path = common.json_output(args)
    report = memory_report(config)
    common.print_table(memory_table(report))
    common.console.print("MiB: 2^20 bytes; B/param: bytes per parameter. Saved for backward: one micro-batch's "
                         "activations (and autocast's weight copies), held from its forward to its backward.",
                         highlight=False)
    if json_path is not None:
        json_path.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        common.console.print(f"wrote {json_path}")
    return 0


def memory_table(report: MemoryReport) -> Table:
    """A MemoryReport as a table, one row per kind: MiB and bytes/parameter of the run and of each baseline. No cell
    wraps; the table is 89 columns wide."""
    c = report.config
    master = f" · master {c.master}" if c.master != "fp32" else ""
    t = Table(title=f"MiB of {c.model} ({report.params / 1e6:.2f}M params) · {c.preset}{master} · "
                    f"{report.optimizer} · batch {c.batch_size} × {c.seq_len}")
    t.add_column("", no_wrap=True)
    columns = {"this run": report.measured, **report.baselines}
    for name in columns:
        t.add_column(name, justify="right", no_wrap=True)
        t.add_column("B/param", justify="right", no_wrap=True)
    for kind, label in ROWS.items():
        cells = []
        for footprint in columns.values():
            cells += [f"{footprint.to_dict()[kind] / MIB:.2f}", f"{report.per_param(kind, footprint):.2f}"]
        t.add_row(label, *cells, end_section=kind == "saved")
    return t


HELP = "measure the bytes of one training step by kind, beside fp32 / bf16 AdamW"  # its line in `minifloat --help`


def add_parser(sub) -> None:
    from minifloat.training.config import TrainConfig
    from minifloat.training.model import SIZES
    from minifloat.training.optimizer import MASTER_UPDATES

    d = TrainConfig()
    m = sub.add_parser("memory", help=HELP, description=cmd_memory.__doc__)
    m.add_argument("--model", default="10m", help=f"model size: {', '.join(SIZES)} (default 10m)")
    m.add_argument("--preset", default="fp8-delayed", help="precision preset (default fp8-delayed)")
    m.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"sequences per micro-batch (default {d.batch_size})")
    m.add_argument("--seq-len", type=int, default=d.seq_len, help=f"bytes per sequence (default {d.seq_len})")
    m.add_argument("--seed", type=int, default=d.seed, help=f"seed for weights and batch (default {d.seed})")
    m.add_argument("--data", default=None, help="text files or token shards, as `minifloat train --data` reads "
                                               "them (default: the Python standard library)")
    m.add_argument("--tokenizer", default=None, metavar="FILE",
                   help="tokenizer.json for --data text, as `minifloat train --tokenizer` (default: bytes)")
    m.add_argument("--max-bytes", type=int, default=d.max_bytes,
                   help=f"cap on the corpus bytes read (default {d.max_bytes})")
    m.add_argument("--optimizer-state", default="fp32,fp32", metavar="FMT_M,FMT_V",
                   help="formats of AdamW's two moments, stored per block of 128: fp32, bf16, e4m3, e5m2, int8, "
                        "int8-dynamic, int4 or int4-dynamic each (default fp32,fp32: torch.optim.AdamW)")
    m.add_argument("--master", default="fp32", metavar="MODE",
                   help=f"how the weights keep small updates, as `minifloat train --master`: "
                        f"{', '.join(MASTER_UPDATES)} (default fp32)")
    m.add_argument("--json", default=None, metavar="PATH",
                   help="also write the report as JSON to PATH (a new file, or --overwrite)")
    m.add_argument("--overwrite", action="store_true", help="replace the file --json names if it exists")
    m.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    m.set_defaults(func=cmd_memory)
