"""Entry point of one rank of the property test (see torch_prop_worker.py)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch_prop_worker  # noqa: E402

torch_prop_worker.prop(*sys.argv[1:])
