"""`python -m minifloat.train [train flags]`: one rank of `minifloat train`, the entry torchrun starts.

    torchrun --nproc-per-node 2 -m minifloat.train --parallel ddp --steps 100 --out runs/ddp

takes the flags of `minifloat train` (and -v / --debug anywhere among them); `minifloat train --nproc N` starts N of
these itself (minifloat.cli.launch).
"""

import sys

from minifloat.cli import main

GLOBAL_FLAGS = ("-v", "--verbose", "--debug")


def run(argv: list[str]) -> int:
    """Run `minifloat train` with `argv`, then leave the process group the run joined. Ctrl-C while torch imports
    (the first seconds of a rank) is one line and status 130, as for `minifloat` itself."""
    try:
        import torch.distributed as dist
    except KeyboardInterrupt:
        if "--debug" in argv:
            raise
        print("minifloat: error: interrupted", file=sys.stderr)
        return 130

    try:
        return main([*(a for a in argv if a in GLOBAL_FLAGS), "train", *(a for a in argv if a not in GLOBAL_FLAGS)])
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
