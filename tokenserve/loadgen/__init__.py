"""``tokenserve bench``: a serving benchmark for tokenserve (and any MindIE-compatible server).

Modules, one job each::

    workload.py     prompts (exact token lengths from the model's tokenizer), output lengths
    clients.py      one request builder + stream parser per API family, aiohttp streaming
    metrics.py      pure arithmetic: per-request records -> TTFT/TPOT/ITL/E2E/goodput summary
    baseline_hf.py  the same workload through transformers' generate (static batches)
    serving.py      runner, concurrency sweep, modes, ``main(argv)``
    server.py       ``tokenserve serve`` as a child process on a free loopback port
    report.py       table on stdout, JSON file, PNG plots

Installed with ``tokenserve`` (``passages_repeat.json`` is package data); the optional
dependencies are the ``bench`` extra. It builds the engine a server would have from the
``serve`` flags of :mod:`tokenserve.config.flags`, never from :mod:`tokenserve.cli` (which
imports this package lazily, in ``tokenserve bench``). The kernel micro-benchmarks and
other developer scripts stay in the repository's top-level ``bench/`` package.
"""
