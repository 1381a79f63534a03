"""Accuracy of the weight formats against the fp32 model (issue 12): mean KL divergence of the
next-token distributions, teacher-forced on the fp32 model's greedy continuation.

    python -m bench.quant_accuracy [--model PATH] [--positions 64] [--prompts N] [--out FILE]

For each of the 32 prompts of ``bench/prompts_accuracy.json`` (chat user turns in several
languages, and code requests; chat template applied): the fp32 model generates ``--positions``
greedy tokens (``ignore_eos``: the continuation always has that many); then every model reads
prompt + continuation in one prefill and its distributions at those positions are compared
with the fp32 ones::

    KL(p_fp32 || p_variant) = sum_v p_fp32(v) (log p_fp32(v) - log p_variant(v))   (nats)

averaged over all positions of all prompts. Variants: ``bf16`` (bf16 weights and
activations), ``int8`` (``--quantization int8``: int8 weights per channel, bf16 activations),
``gguf`` (``--quantization gguf``: the file's own Q4_1/Q8_0 blocks; GGUF models only). Also
reported: the share of positions whose argmax equals fp32's (``top1``), and the worst
prompt's mean KL. llama.cpp's own logits would need ``llama-cpp-python`` (``llama_cpp``);
the row is left out when it is not importable.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.llama import LlamaForCausalLM
from tokenserve.models.loader import ModelConfig, gguf_source, load_weights, resolve_model
from tokenserve.models.tokenizer import Tokenizer

PROMPTS = Path(__file__).resolve().parent / "prompts_accuracy.json"
BLOCK = 16


def _build(model: str | None, dtype: torch.dtype, quantization: str) -> LlamaForCausalLM:
    d = resolve_model(model)
    return LlamaForCausalLM.from_state_dict(
        ModelConfig.from_dir(d), load_weights(d, dtype, quantization, model), dtype,
        torch.device("cpu"))


def _prefill(m: LlamaForCausalLM, ids: list[int], kv=None) -> tuple[torch.Tensor, list]:
    """fp32 logits [len(ids), vocab] of one prefill; returns the KV cache too."""
    nb = (len(ids) + 64 + BLOCK - 1) // BLOCK
    kv = kv or m.allocate_kv_cache(nb, BLOCK)
    meta = AttentionMetadata.build(m.kernels, [list(range(nb))], [len(ids)], [0], BLOCK)
    return m.compute_logits(m.forward(torch.tensor(ids), kv, meta)), kv


def greedy(m: LlamaForCausalLM, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ``ids`` (prefill, then one decode step per token)."""
    logits, kv = _prefill(m, ids)
    nb = kv[0][0].shape[0]
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        meta = AttentionMetadata.build(m.kernels, [list(range(nb))], [1],
                                       [len(ids) + len(out) - 1], BLOCK)
        h = m.forward(torch.tensor(out[-1:]), kv, meta)
        out.append(int(m.compute_logits(h)[-1].argmax()))
    return out


def run(model: str | None = None, positions: int = 64, n_prompts: int | None = None,
        ) -> dict:
    """The study; returns ``{"variants": {name: {"kl_mean", "kl_worst_prompt", "top1",
    "weights_mib"}}, ...}``."""
    d = resolve_model(model)
    tok = Tokenizer(d)
    prompts = json.loads(PROMPTS.read_text(encoding="utf-8"))["prompts"][:n_prompts]
    ref = _build(model, torch.float32, "none")
    variants = {"bf16": _build(model, torch.bfloat16, "none"),
                "int8": _build(model, torch.bfloat16, "int8")}
    if gguf_source(model) is not None:
        variants["gguf"] = _build(model, torch.bfloat16, "gguf")
    kl_sum = {k: 0.0 for k in variants}
    top1 = {k: 0 for k in variants}
    worst = {k: 0.0 for k in variants}
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        text = tok.apply_chat_template([{"role": "user", "content": p["text"]}],
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        cont = greedy(ref, ids, positions)
        seq = ids + cont[:-1]
        span = slice(len(ids) - 1, len(seq))  # the positions that predict cont
        logp = torch.log_softmax(_prefill(ref, seq)[0][span].double(), -1)
        for k, m in variants.items():
            logq = torch.log_softmax(_prefill(m, seq)[0][span].double(), -1)
            kl = (logp.exp() * (logp - logq)).sum(-1)  # [positions]
            kl_sum[k] += float(kl.sum())
            worst[k] = max(worst[k], float(kl.mean()))
            top1[k] += int((logq.argmax(-1) == logp.argmax(-1)).sum())
        print(f"[{i + 1}/{len(prompts)}] {p['lang']}: "
              + ", ".join(f"{k} {kl_sum[k] / ((i + 1) * positions):.5f}" for k in variants)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    total = len(prompts) * positions
    out = {"model": str(d), "prompts": len(prompts), "positions": positions,
           "fp32_weights_mib": ref.weight_bytes / 2**20, "variants": {}}
    for k, m in variants.items():
        out["variants"][k] = {"kl_mean": kl_sum[k] / total, "kl_worst_prompt": worst[k],
                              "top1": top1[k] / total, "weights_mib": m.weight_bytes / 2**20,
                              "formats": m.weight_formats}
    try:
        import llama_cpp  # noqa: F401
        out["llama_cpp"] = "importable, not wired in"
    except ImportError:
        out["llama_cpp"] = "llama-cpp-python (llama_cpp) is not importable: no llama.cpp row"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the default GGUF)")
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    res = run(args.model, args.positions, args.prompts)
    print("| format | weights MiB | mean KL (nats) | worst prompt | top-1 = fp32 |")
    print("|---|---|---|---|---|")
    print(f"| fp32 | {res['fp32_weights_mib']:.1f} | 0 | 0 | 100% |")
    for k, v in res["variants"].items():
        assert math.isfinite(v["kl_mean"])
        print(f"| {k} ({v['formats']}) | {v['weights_mib']:.1f} | {v['kl_mean']:.5f} | "
              f"{v['kl_worst_prompt']:.5f} | {100 * v['top1']:.1f}% |")
    print(res["llama_cpp"])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
