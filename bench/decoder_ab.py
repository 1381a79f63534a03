"""The layer stack looped in C++ (``csrc/decoder.cpp``) against the Python loop, same model,
same process, alternated (so host drift hits both alike).

    python -m bench.decoder_ab [--quantization gguf|none|int8] [--context 160] [--rounds 15]
                               [--residual-scale S]

Builds the default model, fills one request's KV cache to ``--context`` tokens, then times
batch-1 decode steps (forward + fp32 logits, no sampling) ``--rounds`` times x 10 steps with
``model.decoder`` on and off in turn; prints min and median ms per step and the ratio of the
minima, with the CPU model and flags. ``--residual-scale S``: the same weights with
Granite's residual multiplier (``DecoderArch.residual_scale``), so the loop takes
``CausalLM._layer``'s general path, as a Granite model does.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from bench.profile_step import cpu_summary
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import load_config, load_weights, resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default="gguf", choices=["gguf", "none", "int8"])
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--residual-scale", type=float, default=1.0)
    args = ap.parse_args()
    d = resolve_model(None)
    cfg = load_config(d)
    if args.residual_scale != 1.0:
        cfg = dataclasses.replace(cfg, arch=dataclasses.replace(
            cfg.arch, residual_scale=args.residual_scale))
    model = CausalLM.from_state_dict(
        cfg, load_weights(d, torch.bfloat16, args.quantization), torch.bfloat16,
        torch.device("cpu"))
    decoder = model.decoder
    if decoder is None:
        raise SystemExit("no csrc/decoder.cpp here (tokenserve._C not built, or disabled)")
    bs = 128
    blocks = list(range((args.context + 1 + bs - 1) // bs))
    kv = model.allocate_kv_cache(len(blocks), bs)
    ids = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
    model.forward(ids, kv, AttentionMetadata.build(model.kernels, [blocks], [args.context], [0], bs))
    meta = AttentionMetadata.build(model.kernels, [blocks], [1], [args.context], bs)
    last = ids[-1:]
    ms: dict[str, list[float]] = {"C++ decoder": [], "Python loop": []}
    for _ in range(args.rounds):
        for mode, dec in (("C++ decoder", decoder), ("Python loop", None)):
            model.decoder = dec
            t0 = time.perf_counter()
            for _ in range(10):
                model.compute_logits(model.forward(last, kv, meta))
            ms[mode].append((time.perf_counter() - t0) / 10 * 1e3)
    model.decoder = decoder
    print(f"# {cpu_summary()}; {args.quantization}, batch 1, context {args.context}, "
          f"residual scale {args.residual_scale}")
    for mode, v in ms.items():
        print(f"{mode}: min {min(v):.2f} ms, median {statistics.median(v):.2f} ms per step")
    print(f"Python loop / C++ decoder (minima): "
          f"{min(ms['Python loop']) / min(ms['C++ decoder']):.2f}x")


if __name__ == "__main__":
    main()
