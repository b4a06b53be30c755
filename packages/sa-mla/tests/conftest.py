"""sa-mla tests: this folder on the import path, so that the test modules import `mla_cases` (test
support: random problems and error measures)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
