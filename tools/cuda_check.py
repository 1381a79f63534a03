"""One-shot check of tokenserve's accelerator path (CUDA), for a lent GPU machine.

The GPU machine cannot reach a package index and takes at most 64 MiB of files, so the
default model (94 MB GGUF) cannot travel. Instead, on the CPU machine, from the repo root:

    echo /.devcheck/ >> .git/info/exclude; echo /.whl/ >> .git/info/exclude
    python tools/cuda_check.py prepare          # .devcheck/: a tiny random Llama with
                                                # the real tokenizer, and SmolLM2's config
    pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 -d .whl orjson gguf   # missing there

then on the GPU machine (carry .whl and .devcheck), from the repo root:

    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 tools/cuda_check.py run cuda [--quick]

It checks, on the device: chunked-prefill and decode logits against transformers (fp32
and bf16), length-grouped decode attention against transformers' greedy tokens, CPU vs
device engine outputs (greedy, 8 concurrent requests, no leaked KV blocks), the HTTP
server on the device (OpenAI, TGI stream, MindIE, a 4xx, /metrics), then step timings and
the mixed-workload chunked-prefill bench on a random model of SmolLM2-135M's shape.
Results: $OUT/devcheck.json (or /tmp/devcheck-out).
"""
# one-shot tool: its closures run inside their loop
# ruff: noqa: B023, PLW1510
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
import torch
import transformers

from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.engine.model_runner import ModelRunner
from tokenserve.messages import GenerateRequest, ScheduledSeq, SeqStart, StepPlan
from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import load_config, load_weights
from tokenserve.sampling_params import SamplingParams

DEV = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "run" else "cpu"
QUICK = "--quick" in sys.argv
OUT = os.environ.get("OUT", "/tmp/devcheck-out")
os.makedirs(OUT, exist_ok=True)
TINY = ".devcheck/tiny"
RES: dict = {"device": DEV}


def log(*a):
    print(*a, flush=True)


def section(name):
    def deco(f):
        def run():
            t = time.perf_counter()
            try:
                RES[name] = f()
                RES[name + "_ok"] = True
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                RES[name] = f"FAILED: {type(e).__name__}: {e}"
                RES[name + "_ok"] = False
            log(f"== {name}: {time.perf_counter() - t:.1f} s: {RES[name]}")
            with open(f"{OUT}/devcheck.json", "w") as fh:
                json.dump(RES, fh, indent=1, default=str)
        return run
    return deco


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


@section("env")
def env():
    d = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if DEV == "cuda":
        d["gpu"] = torch.cuda.get_device_name(0)
    return d


def seq(rid, ids, start, n, table, params=None, sample=True):
    # the sampling state's start goes with every step: the runner reads it only the first
    # time it sees the request id
    return ScheduledSeq(rid, tuple(ids[start:start + n]), start, tuple(table), sample,
                        params or SamplingParams(), start=SeqStart(tuple(ids), len(ids)))


@section("logits_vs_transformers")
def logits():
    hf = transformers.LlamaForCausalLM.from_pretrained(TINY, torch_dtype=torch.float32).to(DEV).eval()
    cfg = load_config(TINY)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        ours = CausalLM.from_state_dict(cfg, load_weights(TINY, dt), dt, torch.device(DEV))
        runner = ModelRunner(ours, num_blocks=64, block_size=16)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 49000, (200,), generator=g).tolist()
        cap = []
        orig = ours.compute_logits
        ours.compute_logits = lambda h: cap.append(orig(h)) or cap[-1]
        table = list(range(14))
        # chunked: 64 + 64 + 72, then one decode
        runner.step(StepPlan(0, [seq("a", ids, 0, 64, table, sample=False)]))
        runner.step(StepPlan(1, [seq("a", ids, 64, 64, table, sample=False)]))
        runner.step(StepPlan(2, [seq("a", ids, 128, 71, table)]))
        runner.step(StepPlan(3, [seq("a", ids, 199, 1, table)]))
        with torch.no_grad():
            ref = hf(torch.tensor([ids], device=DEV)).logits[0].float()
        e1 = (cap[0][0].float() - ref[198]).abs().max().item()
        e2 = (cap[1][0].float() - ref[199]).abs().max().item()
        out[str(dt)] = {"chunked_prefill_max_abs_err": e1, "decode_max_abs_err": e2,
                        "logit_scale": ref.abs().max().item()}
    assert out["torch.float32"]["chunked_prefill_max_abs_err"] < 1e-3, out
    assert out["torch.float32"]["decode_max_abs_err"] < 1e-3, out
    return out


@section("grouped_decode_vs_transformers")
def grouped():
    hf = transformers.LlamaForCausalLM.from_pretrained(TINY, torch_dtype=torch.float32).to(DEV).eval()
    cfg = load_config(TINY)
    ours = CausalLM.from_state_dict(cfg, load_weights(TINY, torch.float32), torch.float32,
                                            torch.device(DEV))
    runner = ModelRunner(ours, num_blocks=256, block_size=16)
    g = torch.Generator().manual_seed(2)
    lens = (700, 3, 5, 40, 3, 129, 2)
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in lens]
    tables, nxt = [], 0
    for n in lens:
        k = n // 16 + 1
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    runner.step(StepPlan(0, [seq(f"r{i}", p, 0, len(p) - 1, t, sample=False)
                             for i, (p, t) in enumerate(zip(prompts, tables))]))
    res = runner.step(StepPlan(1, [seq(f"r{i}", p, len(p) - 1, 1, t)
                                   for i, (p, t) in enumerate(zip(prompts, tables))]))
    with torch.no_grad():
        want = {f"r{i}": int(hf(torch.tensor([p], device=DEV)).logits[0, -1].argmax())
                for i, p in enumerate(prompts)}
    assert res.sampled == want, (res.sampled, want)
    return "equal"


async def engine_outputs(device, prompts):
    cfg = EngineConfig(model=TINY, dtype="float32", device=device, block_size=16,
                       kv_cache_bytes=32 << 20, max_num_batched_tokens=64)
    eng = await asyncio.to_thread(AsyncEngine.build, cfg)
    await eng.start()

    async def one(i, p):
        g = GenerateRequest(f"r{i}", tuple(p), SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                              seed=i))
        toks = []
        async for o in eng.generate(g):
            toks += o.new_token_ids
        return toks
    outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    await eng.wait_idle()
    st = eng.stats()
    await eng.stop()
    assert st.num_free_blocks == st.num_blocks, "leak"
    return outs


@section("engine_cpu_vs_device")
def engine():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist()
               for n in (5, 300, 17, 90, 2, 150, 33, 64)]
    a = asyncio.run(engine_outputs("cpu", prompts))
    b = asyncio.run(engine_outputs(DEV, prompts))
    same = sum(x == y for x, y in zip(a, b))
    assert same == len(prompts), (a, b)
    return f"{same}/{len(prompts)} greedy outputs equal, no leaked blocks"


@section("http_on_device")
def http():
    import argparse

    import httpx

    from tokenserve.loadgen.server import ServerProcess

    server = ServerProcess(argparse.Namespace(dtype="float32", device=DEV, model=TINY,
                                              server_args=""))
    server.start()
    u = server.url
    try:
        out = {}
        r = httpx.post(f"{u}/v1/completions", json={"model": "tiny", "prompt": "Hello there",
                                                    "max_tokens": 8, "ignore_eos": True}, timeout=60)
        out["openai"] = (r.status_code, r.json().get("usage"))
        assert r.status_code == 200, r.text
        r = httpx.post(f"{u}/generate_stream", json={"inputs": "Hi", "parameters": {"max_new_tokens": 5}},
                       timeout=60)
        out["tgi_stream"] = (r.status_code, r.text.count("data:"))
        r = httpx.post(f"{u}/infer_token", json={"input_id": [1, 2, 3]}, timeout=60)
        out["infer_token"] = (r.status_code, r.text[:120])
        assert r.status_code == 200
        r = httpx.post(f"{u}/v1/chat/completions", json={"model": "x", "messages": "nope"}, timeout=60)
        out["chat_bad"] = r.status_code
        assert 400 <= r.status_code < 500
        r = httpx.post(f"{u}/infer", json={"inputs": "Say hi", "stream": False,
                                          "parameters": {"max_new_tokens": 4}}, timeout=60)
        out["infer"] = (r.status_code, r.text[:160])
        assert r.status_code == 200
        m = httpx.get(f"{u}/metrics", timeout=10)
        out["metrics"] = (m.status_code, "request_success_total" in m.text or len(m.text))
        return out
    finally:
        server.stop()


@section("make_random_smollm_shape")
def make_random():
    if os.path.exists("/tmp/rand135m/model.safetensors"):
        return "exists"
    hc = transformers.AutoConfig.from_pretrained(".devcheck/smol")
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(hc).to(torch.bfloat16)
    m.save_pretrained("/tmp/rand135m")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(f".devcheck/smol/{f}", "/tmp/rand135m/")
    return "saved"


@section("step_timings_bf16")
def timings():
    d = "/tmp/rand135m"
    cfg = load_config(d)
    m = CausalLM.from_state_dict(cfg, load_weights(d, torch.bfloat16), torch.bfloat16,
                                         torch.device(DEV))
    bs = 128
    r = ModelRunner(m, 2000, bs)
    out = {}

    def mk(ctxs):
        seqs, nb = [], 0
        for b, ctx in enumerate(ctxs):
            toks = torch.randint(100, 20000, (ctx + 1,)).tolist()
            k = ctx // bs + 1
            seqs.append(seq(f"r{b}", toks, ctx, 1, list(range(nb, nb + k))))
            nb += k
        return seqs

    def timeit(plan_fn, n=10):
        for _ in range(3):
            r.step(plan_fn())
        sync()
        t = time.perf_counter()
        for _ in range(n):
            r.step(plan_fn())
        sync()
        return round((time.perf_counter() - t) / n * 1e3, 2)

    cases = {"B1x160": [160], "B16x160": [160] * 16, "B64x160": [160] * 64,
             "B64x600": [600] * 64, "B15x100+1x3000": [100] * 15 + [3000], "B200x600": [600] * 200}
    if QUICK:
        cases = {"B16x160": [160] * 16}
    for name, ctxs in cases.items():
        seqs = mk(ctxs)
        out["decode_" + name + "_ms"] = timeit(lambda: StepPlan(0, seqs))
    toks = torch.randint(100, 20000, (3000,)).tolist()
    table = list(range(30))
    for chunk in ((3000, 1024, 256) if not QUICK else (256,)):
        def run_prefill():
            s = 0
            while s < 3000:
                n = min(chunk, 3000 - s)
                r.step(StepPlan(0, [seq("p", toks, s, n, table, sample=s + n == 3000)]))
                s += n
        run_prefill()
        sync()
        t = time.perf_counter()
        for _ in range(3):
            run_prefill()
        sync()
        out[f"prefill3000_chunk{chunk}_ms"] = round((time.perf_counter() - t) / 3 * 1e3, 1)
    return out


@section("bench_mixed_http")
def bench():
    res = {}
    for mode, extra in (("chunked", ""), ("whole", " --no-enable-chunked-prefill")):
        outp = f"{OUT}/bench-{mode}.json"
        cmd = [sys.executable, "-m", "tokenserve.cli", "bench", "--backend", "mindie",
               "--model", "/tmp/rand135m", "--device", DEV, "--dataset", "mixed",
               "--input-len", "64", "--long-input-len", "2048", "--long-fraction", "0.1",
               "--output-len", "32", "--concurrency", "32", "--num-prompts",
               "40" if QUICK else "200", "--request-rate", "8", "--seed", "1", "--no-progress",
               "--server-args", "--max-num-batched-tokens 1024" + extra, "--out", outp]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        log(p.stdout[-1500:], p.stderr[-1500:])
        rep = subprocess.run([sys.executable, "bench/chunked_prefill_report.py", outp,
                              "--short-max", "128"], capture_output=True, text=True)
        res[mode] = rep.stdout.strip().splitlines()[-1] if rep.returncode == 0 else rep.stderr[-500:]
    return res


def prepare() -> None:
    """Write .devcheck/tiny (random 2-layer Llama with the default model's tokenizer) and
    .devcheck/smol (SmolLM2-135M's config and tokenizer, no weights)."""
    from tokenserve.models.loader import resolve_model

    src = resolve_model(None)
    real = json.loads((src / "config.json").read_text())
    torch.manual_seed(0)
    hc = transformers.LlamaConfig(
        vocab_size=real["vocab_size"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
        eos_token_id=real.get("eos_token_id", 2), bos_token_id=real.get("bos_token_id", 1))
    transformers.LlamaForCausalLM(hc).eval().float().save_pretrained(TINY)
    os.makedirs(".devcheck/smol", exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, TINY)
        shutil.copy(src / f, ".devcheck/smol")
    shutil.copy(src / "config.json", ".devcheck/smol")


if __name__ == "__main__":
    if sys.argv[1:2] == ["prepare"]:
        prepare()
    elif sys.argv[1:2] == ["run"]:
        for step in (env, logits, grouped, engine, http, make_random, timings, bench):
            step()
        log(json.dumps(RES, indent=1, default=str))
    else:
        sys.exit(__doc__)
