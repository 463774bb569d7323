"""``python -m functrain`` (and ``torchrun -m functrain train cfg.yaml``) runs the ``functrain`` command."""

import sys

from functrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
