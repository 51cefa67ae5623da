"""`python -m minifloat ...`: the same command line as the `minifloat` script."""

from minifloat.cli import main

raise SystemExit(main())
