"""`python -m sa_layers.demo`: the same as `sa-demo`."""

import sys

from . import main

sys.exit(main())
