"""`python -m umem_jax COMMAND ...`: the `umem-jax` command without its console script (a
checkout on PYTHONPATH, a venv whose scripts are not on PATH)."""

import sys

from .cli import main

sys.exit(main())
