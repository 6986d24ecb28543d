"""The paper-table runner behind ``scripts/reproduce_table.py`` (which holds the command line and its help),
one job per module:

* :mod:`.registry` - what each table is and runs: :class:`~.registry.Table`, ``TABLES``, the delegates'
  drivers, the benchmarks' specs (``BENCH``), a table's cells (:func:`~.registry.table_cells`), and every list
  of the tables: ``--list`` (also the README's index), the ``make help`` lines. A new table is its experiment
  configs plus one ``Table`` (docs/adding_a_table.md).
* :mod:`.config` - a cell's ``train.py`` config: composing it with Hydra, its kind, its CPU-proxy ``scale``
  option, whether it can start.
* :mod:`.runner` - launching runs: one cell (``train.py`` under torchrun, or its CPU proxy), the FID sampling
  of generation cells, the export of released weights, the delegated drivers.
* :mod:`.benchmark` - DiT forward time across M (Table 14, Table 7b's throughput).
* :mod:`.writers` - ``results/<table>[_mini].md`` and ``.json``: the paper's numbers beside ours, and reading
  the saved rows back (``--only``).
* :mod:`.figures` - ``results/<table>[_mini].png``: the paper's number and ours per cell as grouped bars
  (``--plot-only`` redraws it from the ``.json``).
* :mod:`.builders` - one table end to end, per family: cells (with seeds and ``--only``), bench, delegate.
* :mod:`.proxy2` - Table 2's seeded CPU proxy (``--table 2 --scale mini``), its table and plot.
* :mod:`.params` - ``results/params.md``: every cell's parameters and GMACs beside the paper's
  (``scripts/count_params.py``, ``make params``).
* The tables with a driver of their own (``registry.DELEGATES``, run in this process): :mod:`.table5` (Wan2.1
  fine-tunes: commands or ``--run``, the latency table), :mod:`.table5_mini` (its CPU proxy), :mod:`.lm_tables`
  (Tables 6 and 8 on trained LMs), :mod:`.mqar` (the MQAR grid; ``scripts/run_mqar.py``).
* The experiments beside the paper's tables, each with its own command line: :mod:`.cross_mini` (cross-attention
  on the video mini model, ``python -m scripts.tables.cross_mini``), :mod:`.conversion` and its results file
  :mod:`.conversion_report` (softmax converted to MHLA against training from scratch, ``python -m
  scripts.tables.conversion``).
* The one writer of results files is :mod:`tasks.common.results` (``write_result``: md + json + png, whole; a
  benchmark's ``measurement`` refused when busy unless allowed, then marked BUSY), used by every table and
  benchmark, and by the task-side drivers, which is why it lives below both.

Modules call each other's functions through the module (``registry.table_cells(...)``), not through names
imported from it, so a test that monkeypatches a function where it is defined changes every caller."""
