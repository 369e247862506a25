"""arithinterp: how does a language model do arithmetic?

A toolkit for arithmetic circuits in TransformerLens hooked models: activation patching,
linear probes and error detection, Fourier and helix fits, heuristic neurons, plots and reports.
"""

__version__ = "0.1.0"

from arithinterp.errors import ArithInterpError  # noqa: E402
from arithinterp.models import list_zoo, load_model  # noqa: E402

__all__ = ["ArithInterpError", "load_model", "list_zoo", "__version__"]
