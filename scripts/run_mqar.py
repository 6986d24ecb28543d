#!/usr/bin/env python
"""MQAR grid: attention variants x sequence lengths x key-value counts x seeds -> table, plots and raw records.

    python scripts/run_mqar.py --scale mini      # CI-size check (N = 32, K = 2; about 10 min)
    python scripts/run_mqar.py                   # the committed grid -> results/mqar.md
    python scripts/run_mqar.py --help            # every option, with more examples

The driver is :mod:`scripts.tables.mqar` (its docstring, which ``--help`` prints, says what each run is);
``make reproduce-mqar`` and ``scripts/reproduce_table.py --table mqar`` run the same.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and not __package__:  # run as a file: import from the root, not scripts/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from scripts.tables.mqar import main

if __name__ == "__main__":
    sys.exit(main())
