"""tokenserve: an LLM inference server speaking MindIE Service's APIs."""

__version__ = "0.1.0"
