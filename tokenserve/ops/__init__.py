"""Kernels: the C++ extension ``tokenserve._C`` when it is built, else pure-torch references.

Which one runs is decided in one place, ``tokenserve/ops/dispatch.py`` (``load_kernels``,
``Kernels``, ``c_op``; ``TOKENSERVE_DISABLE_C=1`` forces the references,
``TOKENSERVE_KERNELS_SO=path`` loads a development build). The references:
``reference.py`` (paged attention), ``layer_ref.py`` (decoder-layer and block-table ops),
``sampling.py`` (sampling), ``quant.py`` / ``quant_int8.py`` (quantised weights, whose types
and layouts are in ``quant_blocks.py``); ``linear.py`` picks each projection's GEMM.
"""
