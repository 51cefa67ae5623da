"""Peak memory of `minifloat tokenize` on a folder with one large text file (issue 23: real token data).

One large file is the common case the streaming must hold to (TinyStories ships a 2 GB train.txt): its memory must
not grow with the file. The folder is built from the Python standard library's sources (on every machine): one file
of about --mb megabytes (whole copies of the sources, about 9 MB each) and four small ones, so the split has a
validation part. Each size runs `minifloat tokenize` in its own process; the peak resident memory is the child's
(getrusage), and the table gives it with the ratio to the smallest size's.

    python benchmarks/tokenize_memory.py                       # 25, 50 and 100 MB, BPE of 2000 ids
    python benchmarks/tokenize_memory.py --mb 50,200 --json runs/tokenize_memory.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import machine  # noqa: E402 - benchmarks/machine.py


def build_folder(root: pathlib.Path, megabytes: int) -> int:
    """root/big.txt of about `megabytes` MB and four small files; returns big.txt's size in bytes."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    sources = "\n".join(p.read_text(encoding="utf-8", errors="ignore") for p in sorted(stdlib.glob("*.py")))
    root.mkdir(parents=True)
    with open(root / "big.txt", "w", encoding="utf-8") as f:
        written = 0
        while written < megabytes * 1_000_000:
            f.write(sources)
            written += len(sources)
    for i in range(4):
        (root / f"small{i}.txt").write_text(sources[i * 20_000:(i + 1) * 20_000], encoding="utf-8")
    return (root / "big.txt").stat().st_size


def peak_rss_mib(args: list[str]) -> tuple[float, float]:
    """(peak resident memory in MiB, wall seconds) of `python -m minifloat ARGS` in its own process tree."""
    rss, seconds, code, err = machine.child_peak(["-m", "minifloat", *args])
    if code != 0:
        raise SystemExit(f"minifloat {' '.join(args)} failed (exit {code}):\n{err}")
    return rss, seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", default="25,50,100", help="comma list of the large file's sizes in MB")
    p.add_argument("--vocab-size", type=int, default=2000)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    machine.add_overwrite(p)
    args = p.parse_args()
    machine.keep_existing(p, args, "json")
    sizes = [int(s) for s in args.mb.split(",") if s.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="minifloat-tokenize-memory-") as tmp:
        for mb in sizes:
            folder = pathlib.Path(tmp) / f"text{mb}"
            nbytes = build_folder(folder, mb)
            out = pathlib.Path(tmp) / f"tok{mb}"
            rss, seconds = peak_rss_mib(["tokenize", "--data", str(folder), "--out", str(out),
                                         "--vocab-size", str(args.vocab_size)])
            rows.append({"file_mb": nbytes / 1e6, "peak_rss_mib": rss, "seconds": seconds})
            print(f"large file {nbytes / 1e6:8.1f} MB   peak RSS {rss:8.0f} MiB   "
                  f"x smallest {rss / rows[0]['peak_rss_mib']:.2f}   {seconds:6.1f} s", flush=True)
    if args.json:
        out = pathlib.Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M"),
                                   "vocab_size": args.vocab_size, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
