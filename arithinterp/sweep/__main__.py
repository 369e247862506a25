"""``python -m arithinterp.sweep CONFIG [flags]`` (see :func:`arithinterp.sweep.cli.main`)."""

import sys

from arithinterp.sweep.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
