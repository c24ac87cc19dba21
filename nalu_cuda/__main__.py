"""``python -m nalu_cuda``: the ``nalu-cuda`` command line (see :mod:`nalu_cuda.cli`)."""
import sys

from .cli import main

sys.exit(main())
