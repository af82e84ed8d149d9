"""kfacflow entry point: ``python run.py RECIPE.yaml [key.sub=value ...]`` (see ``--help``)."""

import sys

from kfacflow.cli import main

if __name__ == "__main__":
    sys.exit(main())
