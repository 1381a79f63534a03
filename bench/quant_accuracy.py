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
``gguf`` (``--quantization gguf``: the file's own Q4_1/Q8_0 blocks; GGUF models only),
``gguf+kv8`` (the default server: those blocks with the int8 KV cache, ``--kv-cache-dtype
int8``, whose rows the prefill writes and its attention reads back; the other variants keep
a cache of the model dtype). Also
reported: the share of positions whose argmax equals fp32's (``top1``), and the worst
prompt's mean KL.

``llamacpp``: llama.cpp's own logits on the same GGUF file, through ``llama-cpp-python``
(``llama_cpp``, a ctypes binding: no build of its own needed when a ``libllama.so`` exists).
The same token ids are fed (no BOS added by llama.cpp: our chat template already starts with
it), one ``llama_decode`` of prompt + continuation with logits for every position, fp32, full
vocabulary; llama.cpp's defaults otherwise (f16 KV cache), ``--llamacpp-threads`` threads.
``--llamacpp-lib DIR`` points at the directory holding ``libllama.so`` (it sets
``LLAMA_CPP_LIB_PATH``); when ``llama_cpp`` is not importable, the llama-cpp-python source
tree above DIR (e.g. ``<sdist>/vendor/llama.cpp/build/bin``) is put on ``sys.path``. Without
a loadable ``llama_cpp`` the row is left out with the reason, the rest still runs; with it,
``gguf_over_llamacpp`` is our gguf KL / llama.cpp's (the issue asks for <= 1.1) and
``top1_vs_gguf`` the share of positions where llama.cpp's argmax equals our gguf path's::

    python -m bench.quant_accuracy --llamacpp-lib \\
        ~/.cache/llama-cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import gguf_source, load_config, load_weights, resolve_model
from tokenserve.models.tokenizer import Tokenizer

PROMPTS = Path(__file__).resolve().parent / "prompts_accuracy.json"
BLOCK = 16


def _build(model: str | None, dtype: torch.dtype, quantization: str) -> CausalLM:
    d = resolve_model(model)
    return CausalLM.from_state_dict(
        load_config(d), load_weights(d, dtype, quantization, model), dtype,
        torch.device("cpu"))


def _prefill(m: CausalLM, ids: list[int], kv=None, kv_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, list]:
    """fp32 logits [len(ids), vocab] of one prefill (a new cache of ``kv_dtype``, None: the
    model dtype, unless ``kv`` is given); returns the KV cache too."""
    nb = (len(ids) + 64 + BLOCK - 1) // BLOCK
    kv = kv or m.allocate_kv_cache(nb, BLOCK, kv_dtype)
    meta = AttentionMetadata.build(m.kernels, [list(range(nb))], [len(ids)], [0], BLOCK)
    return m.compute_logits(m.forward(torch.tensor(ids), kv, meta)), kv


def greedy(m: CausalLM, ids: list[int], n: int) -> list[int]:
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


def kl_top1(ref_logits: torch.Tensor, logits: torch.Tensor,
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (position) of two ``[n, vocab]`` logit tensors: ``KL(p_ref || p)`` in nats
    (float64, softmax of each) and whether the argmaxes agree (bool)."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits shape {tuple(logits.shape)} != reference "
                         f"{tuple(ref_logits.shape)}")
    logp = torch.log_softmax(ref_logits.double(), -1)
    logq = torch.log_softmax(logits.double(), -1)
    return (logp.exp() * (logp - logq)).sum(-1), logq.argmax(-1) == logp.argmax(-1)


def _import_llama_cpp(lib_dir: str | None):
    """``llama_cpp`` (llama-cpp-python), loading ``libllama.so`` from ``lib_dir`` if given;
    if the package is not importable, the llama-cpp-python source tree above ``lib_dir`` is
    tried. Raises what the import raised."""
    if lib_dir:
        lib = Path(lib_dir).expanduser().resolve()
        if not (lib / "libllama.so").is_file():
            raise FileNotFoundError(f"no libllama.so in {lib}")
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    try:
        import llama_cpp
        return llama_cpp
    except ImportError as e:
        if not lib_dir or getattr(e, "name", None) != "llama_cpp":
            raise
        src = next((p for p in lib.parents if (p / "llama_cpp" / "llama_cpp.py").is_file()),
                   None)
        if src is None:
            raise
        sys.path.insert(0, str(src))
        import llama_cpp
        return llama_cpp


def llamacpp_logits(gguf: Path, n_ctx: int, threads: int = 2,
                    lib_dir: str | None = None) -> tuple[Callable[[list[int]], torch.Tensor],
                                                         dict]:
    """A function ``ids -> fp32 logits [len(ids), vocab]`` computed by llama.cpp on ``gguf``
    (one decode of the whole sequence from an empty cache), and a description of the setup."""
    llama_cpp = _import_llama_cpp(lib_dir)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                          n_threads=threads, n_threads_batch=threads, logits_all=True,
                          verbose=False)

    def logits(ids: list[int]) -> torch.Tensor:
        if len(ids) > n_ctx:
            raise ValueError(f"{len(ids)} tokens > llama.cpp n_ctx {n_ctx}")
        llm.reset()  # n_tokens = 0: eval() then drops the whole KV cache
        llm.eval(ids)  # the ids as given: no BOS is added here
        return torch.from_numpy(llm.scores[:len(ids)].copy())

    info = {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
            "lib": str(Path(llama_cpp.llama_cpp._lib._name).resolve()),
            "gguf": str(gguf), "n_ctx": n_ctx, "threads": threads,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    return logits, info


def run(model: str | None = None, positions: int = 64, n_prompts: int | None = None,
        llamacpp_lib: str | None = None, llamacpp_threads: int = 2,
        llamacpp: bool = True) -> dict:
    """The study; returns ``{"variants": {name: {"kl_mean", "kl_worst_prompt", "top1",
    "weights_mib"}}, "llama_cpp": str | dict, ...}``."""
    d = resolve_model(model)
    tok = Tokenizer(d)
    prompts = json.loads(PROMPTS.read_text(encoding="utf-8"))["prompts"][:n_prompts]
    prompt_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p["text"]}],
                                                     add_generation_prompt=True),
                             add_special_tokens=False) for p in prompts]
    ref = _build(model, torch.float32, "none")
    variants: dict[str, object] = {"bf16": _build(model, torch.bfloat16, "none"),
                                   "int8": _build(model, torch.bfloat16, "int8")}
    gguf = gguf_source(model)
    kv_dtypes = {"gguf+kv8": torch.int8}  # variants with another KV cache than the model dtype
    if gguf is not None:
        variants["gguf"] = _build(model, torch.bfloat16, "gguf")
        variants["gguf+kv8"] = variants["gguf"]
    if not llamacpp:
        llama_info: str | dict = "not asked for (--no-llamacpp)"
    elif gguf is None:
        llama_info = "the model is not a GGUF file: no llama.cpp row"
    else:
        n_ctx = max(len(i) for i in prompt_ids) + positions
        try:
            variants["llamacpp"], llama_info = llamacpp_logits(
                gguf, n_ctx, llamacpp_threads, llamacpp_lib)
        except Exception as e:  # noqa: BLE001 - optional: say why and go on without it
            llama_info = (f"llama-cpp-python (llama_cpp) not usable ({type(e).__name__}: {e}); "
                          "no llama.cpp row (--llamacpp-lib DIR with libllama.so)")
            print(llama_info, flush=True)
    kl_sum = {k: 0.0 for k in variants}
    top1 = {k: 0 for k in variants}
    worst = {k: 0.0 for k in variants}
    llama_vs_gguf = 0
    t0 = time.perf_counter()
    for i, (p, ids) in enumerate(zip(prompts, prompt_ids)):
        cont = greedy(ref, ids, positions)
        seq = ids + cont[:-1]
        span = slice(len(ids) - 1, len(seq))  # the positions that predict cont
        ref_logits = _prefill(ref, seq)[0][span]
        argmax = {}
        for k, m in variants.items():
            logits = m(seq) if k == "llamacpp" else _prefill(m, seq, kv_dtype=kv_dtypes.get(k))[0]
            kl, same = kl_top1(ref_logits, logits[span])  # [positions]
            argmax[k] = logits[span].argmax(-1)
            kl_sum[k] += float(kl.sum())
            worst[k] = max(worst[k], float(kl.mean()))
            top1[k] += int(same.sum())
        if "llamacpp" in argmax and "gguf" in argmax:
            llama_vs_gguf += int((argmax["llamacpp"] == argmax["gguf"]).sum())
        print(f"[{i + 1}/{len(prompts)}] {p['lang']}: "
              + ", ".join(f"{k} {kl_sum[k] / ((i + 1) * positions):.5f}" for k in variants)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    total = len(prompts) * positions
    out = {"model": str(d), "prompts": len(prompts), "positions": positions,
           "fp32_weights_mib": ref.weight_bytes / 2**20, "variants": {}}
    for k, m in variants.items():
        out["variants"][k] = {"kl_mean": kl_sum[k] / total, "kl_worst_prompt": worst[k],
                              "top1": top1[k] / total}
        if k == "llamacpp":
            out["variants"][k].update(
                weights_mib=Path(gguf).stat().st_size / 2**20,  # the whole file
                formats="llama.cpp on the GGUF file", top1_vs_gguf=llama_vs_gguf / total)
        else:
            out["variants"][k].update(weights_mib=m.weight_bytes / 2**20,
                                      formats=m.weight_formats
                                      + (", int8 KV cache" if k in kv_dtypes else ""))
    out["llama_cpp"] = llama_info
    if "llamacpp" in out["variants"] and "gguf" in out["variants"]:
        out["gguf_over_llamacpp"] = (out["variants"]["gguf"]["kl_mean"]
                                     / out["variants"]["llamacpp"]["kl_mean"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the default GGUF)")
    ap.add_argument("--positions", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=None, help="only the first N prompts")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--llamacpp-lib", default=None, metavar="DIR",
                    help="directory with llama.cpp's libllama.so for llama-cpp-python "
                         "(default: $LLAMA_CPP_LIB_PATH or the package's own)")
    ap.add_argument("--llamacpp-threads", type=int, default=2)
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp row")
    args = ap.parse_args()
    res = run(args.model, args.positions, args.prompts, args.llamacpp_lib,
              args.llamacpp_threads, not args.no_llamacpp)
    print("| format | weights MiB | mean KL (nats) | worst prompt | top-1 = fp32 |")
    print("|---|---|---|---|---|")
    print(f"| fp32 | {res['fp32_weights_mib']:.1f} | 0 | 0 | 100% |")
    for k, v in res["variants"].items():
        assert math.isfinite(v["kl_mean"])
        print(f"| {k} ({v['formats']}) | {v['weights_mib']:.1f} | {v['kl_mean']:.5f} | "
              f"{v['kl_worst_prompt']:.5f} | {100 * v['top1']:.1f}% |")
    if isinstance(res["llama_cpp"], dict):
        print(f"llama.cpp: argmax = our gguf's at "
              f"{100 * res['variants']['llamacpp']['top1_vs_gguf']:.1f}% of positions; "
              f"gguf KL / llama.cpp KL = {res['gguf_over_llamacpp']:.3f} (issue: <= 1.1)")
    else:
        print(res["llama_cpp"])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
