"""Developer benchmarks of a repository checkout, run as ``python -m bench.X``: the kernel
micro-benchmarks (``kernels.py``, ``kernels_*.py``; also ``tokenserve bench kernels``),
``profile_step``, ``decoder_ab``, ``quant_accuracy``, ``spec_identity``, ``pd_handoff`` and
``chunked_prefill_report``. Not installed; the serving benchmark (``tokenserve bench``) is
the installed package :mod:`tokenserve.loadgen`.
"""
