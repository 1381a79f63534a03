"""The configuration: one typed tree (:mod:`~tokenserve.config.tree`) and one module per
source that maps onto it: :mod:`~tokenserve.config.mindie_json` (MindIE's config.json),
:mod:`~tokenserve.config.flags` (the ``serve`` and ``coordinator`` command lines),
:mod:`~tokenserve.config.env` (every environment variable the program reads);
:mod:`~tokenserve.config.resolve` turns settings into a device and a checked model path.

This package re-exports nothing and imports no other part of tokenserve (a pyproject.toml
contract), so every layer, the kernels' dispatch included, can stand on it.
"""
