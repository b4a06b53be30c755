"""Puts this folder on `sys.path`, so that the tests import their helper modules (`qsa_cases`,
`step5_cases`, `distillation_cases`: test support, not part of the package) by name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
