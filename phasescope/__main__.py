"""`python -m phasescope` runs the CLI. The guard matters: vLLM spawns engine processes that re-import this module."""

import sys

from phasescope.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
