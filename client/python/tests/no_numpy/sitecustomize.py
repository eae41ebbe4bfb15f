"""Run at start by an interpreter whose PYTHONPATH holds this folder: numpy
cannot be imported, as on a machine where ``pip install torch`` brought torch
alone (torch does not depend on numpy, and ``Tensor.numpy()`` then raises
"Numpy is not available"). The tests that put it on the path check that
warden's own paths (an async save's write, a heal's transfer) need no numpy.
"""

import sys

sys.modules["numpy"] = None  # type: ignore[assignment]  # import numpy: ImportError
