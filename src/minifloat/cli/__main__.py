import sys

from minifloat.cli import main

sys.exit(main())
