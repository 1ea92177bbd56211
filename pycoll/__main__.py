"""Run the pycoll CLI as `python -m pycoll`."""

import sys

from pycoll.cli import main

if __name__ == "__main__":
    sys.exit(main())
