"""The package's version: the one place it is written (``pyproject.toml`` reads it from here).

A module of its own so that what records the version (saved results, reports, sweep manifests)
takes it from the bottom layer instead of importing the package root.
"""

__version__ = "0.1.0"
