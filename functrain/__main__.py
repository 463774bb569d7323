"""``python -m functrain`` (and ``torchrun -m functrain train cfg.yaml``) runs the ``functrain`` command."""

from functrain.cli import run

if __name__ == "__main__":
    run()
