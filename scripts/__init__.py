"""The command-line scripts (``python scripts/<name>.py``) and the packages behind them (:mod:`scripts.tables`:
the paper tables, their CPU proxies, MQAR and the results writer every table and benchmark goes through).

Scripts import each other through this package (``from scripts.tables import registry``, ``from scripts import
bench_ops``), never through ``scripts/`` on ``sys.path``. Run as a file, an entry script first puts the root of
its checkout on ``sys.path`` in place of ``scripts/`` (the two-line guard at its top), so ``python
scripts/<name>.py`` imports this checkout's packages; ``python -m scripts.<name>`` from the root does the same."""
