#!/usr/bin/env python
"""``make params``: every table cell's parameters and GMACs beside the paper's column -> results/params.md, .json.

    python scripts/count_params.py                 # every table (about 10 minutes on 2 CPU cores)
    python scripts/count_params.py --tables 2 13   # some tables (written to --out, default results/params)

The counting convention and the check are in :mod:`tables.params` (scripts/tables/params.py) and at the top of
results/params.md.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from scripts.tables import params

if __name__ == "__main__":
    sys.exit(params.main())
