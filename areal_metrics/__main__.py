import sys

from areal_metrics.cli import main

sys.exit(main())
