"""``tokenserve bench``: run a workload against a server (or the bare engine), sweep
concurrency levels, optionally run the transformers baseline, and report.

Flow of one invocation::

    workload (sum of --num-prompts, disjoint slices per level: no prefix-cache reuse)
      |-- ours: --url, or a `tokenserve serve` subprocess on a free loopback port,
      |         or --engine-only (AsyncEngine in this process); with --backend llamacpp
      |         and no --url: a `llama-server` subprocess (--llama-server PATH)
      |     for c in --concurrency: warm-up (excluded) -> measured run -> summary
      |   (server / engine stopped here, so the next system has the cores to itself)
      |-- --llama-server PATH / --llamacpp-url URL (second baseline): the same slices
      |         through llama.cpp's /completion, then that server is stopped
      |-- --baseline hf: the same slices, static batches of c, same weights and dtype
      '-- report: table (stdout), --out JSON, --plot-dir PNGs

Every run is bounded: a fixed number of requests per level and ``--max-duration-s`` per
level, after which the requests still in flight are cancelled and counted as failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import logging
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tokenserve.api.routes import path_of
from tokenserve.loadgen.clients import BACKENDS, get_backend, send_engine, send_http
from tokenserve.loadgen.metrics import RequestRecord, compare, summarize
from tokenserve.loadgen.server import LlamaServer, ServerProcess, cpu_summary, llama_server_ctx
from tokenserve.loadgen.structured import RESPONSE_FORMATS, mask_counters_from_metrics
from tokenserve.loadgen.workload import (
    DATASETS,
    BenchRequest,
    WorkloadConfig,
    build_workload,
    warmup_workload,
    word_ids,
)

log = logging.getLogger("bench")


# --------------------------------------------------------------------------- arguments


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,16,64, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenserve bench",
        description="Serving benchmark: TTFT, TPOT, ITL, E2E, throughput and goodput over "
                    "any API family, a concurrency sweep, a transformers baseline and a "
                    "llama.cpp one. `tokenserve bench kernels -h`: the kernel "
                    "micro-benchmarks (bench/kernels.py of a repository checkout).")
    g = p.add_argument_group("target")
    g.add_argument("--backend", choices=BACKENDS, default="mindie")
    g.add_argument("--url", default=None,
                   help="a running server (http://host:port); default: start `tokenserve "
                        "serve` on a free loopback port and stop it at the end")
    g.add_argument("--engine-only", action="store_true",
                   help="drive AsyncEngine in this process, no HTTP (server overhead = the "
                        "difference to an HTTP run); built from the serve flags and "
                        "--server-args")
    g.add_argument("--model", default=None,
                   help="model dir or .gguf (tokenizer, started server, baseline); default: "
                        "SmolLM2-135M-Instruct")
    g.add_argument("--served-model-name", default=None,
                   help="`model` for openai*/triton requests (default: from /v1/models, else "
                        "the model's name)")
    g.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    g.add_argument("--device", choices=["auto", "cpu", "cuda", "npu"], default="auto")
    g.add_argument("--server-args", default="",
                   help="extra flags for the started `tokenserve serve` (one quoted string)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos (exact output lengths) in every request; default: "
                        "on for the families that have the field (openai, openai-chat, "
                        "vllm, llamacpp; --engine-only follows --backend), off for the "
                        "others (mindie*, tgi, triton), which reject --ignore-eos "
                        "(--engine-only takes it with any backend)")
    l = p.add_argument_group(
        "llama.cpp", "llama.cpp's llama-server: as the target (--backend llamacpp), or as a "
        "second baseline next to ours and --baseline hf (a `llamacpp` row and an "
        "ours/llamacpp ratio per level)")
    l.add_argument("--llama-server", default=None, metavar="PATH",
                   help="llama-server binary to start on a free loopback port (-m GGUF -t "
                        "<nproc> -np <max concurrency> -c <slots x (longest prompt + "
                        "output)>) and stop at the end; with --backend llamacpp and no --url "
                        "it is the target, otherwise the second baseline")
    l.add_argument("--llamacpp-url", default=None, metavar="URL",
                   help="a running llama-server as the second baseline (instead of "
                        "--llama-server); give it -np >= the largest --concurrency")
    l.add_argument("--llamacpp-model", default=None, metavar="GGUF",
                   help="the GGUF for a started llama-server (default: --model when it is a "
                        ".gguf, else the default SmolLM2-135M-Instruct Q4_1 GGUF)")
    l.add_argument("--llama-server-args", default="",
                   help="extra flags for the started llama-server (one quoted string; they "
                        "come last, so e.g. \"-t 1\" overrides)")
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", choices=DATASETS, default="fixed")
    w.add_argument("--input-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--long-input-len", type=int, default=2048,
                   help="mixed dataset: mean prompt length of the long requests")
    w.add_argument("--long-fraction", type=float, default=0.1,
                   help="mixed dataset: share of long requests (0..1)")
    w.add_argument("--shared-prefix-len", type=int, default=0)
    w.add_argument("--num-prompts", type=_int_list, default=[64],
                   help="requests per level: one number, or one per --concurrency level")
    w.add_argument("--concurrency", type=_int_list, default=[16],
                   help="most requests in flight; a list (1,16,64) runs a sweep")
    w.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="Poisson arrivals per second; inf (default) sends at once, bounded "
                        "by --concurrency")
    w.add_argument("--response-format", choices=RESPONSE_FORMATS, default="text",
                   help="json-schema: constrain every request to one JSON schema "
                        "(tokenserve/loadgen/structured.py) in the backend's own field; the "
                        "report adds the engine's mask cost per step")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--warmup", type=int, default=2, help="warm-up requests per level")
    w.add_argument("--max-duration-s", type=float, default=600.0,
                   help="cap per level (ours and baseline each); in-flight requests are "
                        "cancelled and counted as failed")
    m = p.add_argument_group("metrics and output")
    m.add_argument("--slo-ttft-ms", type=float, default=None)
    m.add_argument("--slo-tpot-ms", type=float, default=None)
    m.add_argument("--baseline", choices=["hf"], default=None,
                   help="hf: the same prompts through transformers generate, static batches")
    m.add_argument("--out", default=None, help="write the results JSON here")
    m.add_argument("--plot-dir", default=None, help="write PNG plots here")
    m.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    m.add_argument("--log-level", default="WARNING")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if len(args.num_prompts) not in (1, len(args.concurrency)):
        p.error("--num-prompts takes one number or one per --concurrency level")
    if args.engine_only and args.url:
        p.error("--engine-only and --url exclude each other")
    if args.input_len <= 0 or args.output_len <= 0:
        p.error("--input-len and --output-len must be > 0")
    if not 0 <= args.shared_prefix_len < args.input_len:
        p.error("--shared-prefix-len must be in [0, --input-len)")
    if args.long_input_len <= 0 or not 0.0 <= args.long_fraction <= 1.0:
        p.error("--long-input-len must be > 0 and --long-fraction in [0, 1]")
    if args.max_duration_s <= 0:
        p.error("--max-duration-s must be > 0")
    if args.ignore_eos and not args.engine_only and not get_backend(args.backend).ignore_eos:
        p.error(f"--backend {args.backend} has no ignore_eos field (its requests end at EOS "
                "or max_new_tokens); for exact output lengths use --backend openai, "
                "openai-chat, vllm or llamacpp")
    if args.llama_server and args.llamacpp_url:
        p.error("--llama-server (start one) and --llamacpp-url (use a running one) exclude "
                "each other")
    if args.backend == "llamacpp":
        if args.engine_only:
            p.error("--backend llamacpp drives llama-server over HTTP, not the engine")
        if args.llamacpp_url:
            p.error("--backend llamacpp: give the running llama-server as --url")
        if args.url and args.llama_server:
            p.error("--backend llamacpp: --url (a running llama-server) or --llama-server "
                    "(start one), not both")
        if not args.url and not args.llama_server:
            p.error("--backend llamacpp needs --url http://host:port (a running "
                    "llama-server) or --llama-server PATH (start one)")
    if args.llama_server and not (os.path.isfile(args.llama_server)
                                  and os.access(args.llama_server, os.X_OK)):
        p.error(f"--llama-server {args.llama_server}: not an executable file")


# --------------------------------------------------------------------------- the runner


@dataclass
class LevelResult:
    concurrency: int
    records: list[RequestRecord]
    duration_s: float
    #: speculative decoding during the level: (draft tokens verified, accepted); None
    #: where the target does not report them
    spec: tuple[int, int] | None = None
    #: structured output during the level: (mask ms, steps with a constrained row); None
    #: where the target does not report them
    mask: tuple[float, int] | None = None


def _progress(total: int, desc: str, disable: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=disable,
                leave=True, dynamic_ncols=True)


async def run_level(send: Callable[[BenchRequest], Awaitable[RequestRecord]],
                    reqs: Sequence[BenchRequest], concurrency: int, *,
                    request_rate: float = math.inf, seed: int = 0,
                    max_duration_s: float = 600.0,
                    on_done: Callable[[], None] | None = None) -> LevelResult:
    """Send ``reqs`` with Poisson arrivals (or all at once) and at most ``concurrency`` in
    flight; requests not done after ``max_duration_s`` are cancelled and recorded failed.

    The duration is first send -> last completion (or the cap, when it fired).
    """
    from tokenserve.loadgen.workload import arrival_offsets

    sem = asyncio.Semaphore(concurrency)
    offsets = arrival_offsets(len(reqs), request_rate, seed)
    t0 = time.perf_counter()

    async def one(req: BenchRequest, offset: float) -> RequestRecord:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            rec = await send(req)
        if on_done is not None:
            on_done()
        return rec

    tasks = [asyncio.create_task(one(r, o)) for r, o in zip(reqs, offsets)]
    done, pending = await asyncio.wait(tasks, timeout=max_duration_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    records = []
    for req, task in zip(reqs, tasks):
        if task in done and task.exception() is None:
            records.append(task.result())
        else:
            why = "cancelled at --max-duration-s" if task in pending else repr(task.exception())
            records.append(RequestRecord(req.index, req.input_len, req.output_len, error=why))
    ends = [r.start + r.e2e for r in records if r.ok]
    duration = max_duration_s if pending else (max(ends) - t0 if ends else 0.0)
    if pending:
        log.warning("c=%d: %d requests cancelled at --max-duration-s %.0f", concurrency,
                    len(pending), max_duration_s)
    return LevelResult(concurrency, records, duration)


async def _warm(send: Callable[[BenchRequest], Awaitable[RequestRecord]],
                reqs: Sequence[BenchRequest]) -> None:
    recs = await asyncio.gather(*(send(r) for r in reqs))
    bad = [r.error for r in recs if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up request failed: {bad[0]}")


async def sweep(send: Callable[[BenchRequest], Awaitable[RequestRecord]],
                slices: Sequence[Sequence[BenchRequest]], warm: Sequence[BenchRequest],
                args: argparse.Namespace, label: str,
                spec_counters: Callable[[], Awaitable[tuple[int, int] | None]] | None = None,
                mask_counters: Callable[[], Awaitable[tuple[float, int] | None]] | None = None,
                ) -> list[LevelResult]:
    """Each concurrency level in turn (warm-up first); ``spec_counters`` (the target's
    draft and accepted token counters) and ``mask_counters`` (its structured-output mask
    ms and steps) are read around each level."""
    out = []
    for c, reqs in zip(args.concurrency, slices):
        await _warm(send, warm)
        before = await spec_counters() if spec_counters else None
        mask_before = await mask_counters() if mask_counters else None
        bar = _progress(len(reqs), f"{label} c={c}", args.no_progress)
        try:
            res = await run_level(send, reqs, c, request_rate=args.request_rate,
                                  seed=args.seed, max_duration_s=args.max_duration_s,
                                  on_done=lambda b=bar: b.update(1))
        finally:
            bar.close()
        after = await spec_counters() if spec_counters else None
        if before is not None and after is not None:
            res = replace(res, spec=(after[0] - before[0], after[1] - before[1]))
        mask_after = await mask_counters() if mask_counters else None
        if mask_before is not None and mask_after is not None:
            res = replace(res, mask=(mask_after[0] - mask_before[0],
                                     mask_after[1] - mask_before[1]))
        out.append(res)
    return out


def spec_counters_from_metrics(text: str) -> tuple[int, int] | None:
    """(draft tokens, accepted tokens) from a tokenserve ``/metrics`` page, or None when
    it has no speculative-decoding counters (another server)."""
    vals = {}
    for line in text.splitlines():
        for key in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
            if line.startswith(key):
                vals[key] = int(float(line.rsplit(" ", 1)[1]))
    if len(vals) != 2:
        return None
    return vals["spec_decode_num_draft_tokens_total"], vals["spec_decode_num_accepted_tokens_total"]


def _served_model_name(url: str, fallback: str) -> str:
    import httpx

    try:
        r = httpx.get(url + path_of("openai.models"), timeout=5.0)
        if r.status_code == 200:
            return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        pass
    return fallback


# --------------------------------------------------------------------------- modes


async def run_http(args: argparse.Namespace, url: str, model_name: str, tokenizer: Any,
                   slices: Sequence[Sequence[BenchRequest]],
                   warm: Sequence[BenchRequest], backend_name: str | None = None
                   ) -> list[LevelResult]:
    """One sweep over HTTP through ``backend_name`` (default ``--backend``), on one aiohttp
    session (keep-alive pool of max concurrency + 8 connections; a read may wait up to
    ``--max-duration-s``)."""
    import aiohttp

    backend = get_backend(backend_name or args.backend)
    count_text = (lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
    most = max(args.concurrency)
    connector = aiohttp.TCPConnector(limit=most + 8)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=args.max_duration_s)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as http:
        async def send(req: BenchRequest) -> RequestRecord:
            return await send_http(http, backend, req, model_name, count_text,
                                   ignore_eos=args.ignore_eos,
                                   response_format=args.response_format)

        async def metrics_page() -> str | None:
            try:
                async with http.get(path_of("server.metrics")) as r:
                    return await r.text() if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return None

        async def counters() -> tuple[int, int] | None:
            text = await metrics_page()
            return spec_counters_from_metrics(text) if text is not None else None

        async def masks() -> tuple[float, int] | None:
            text = await metrics_page()
            return mask_counters_from_metrics(text) if text is not None else None

        return await sweep(send, slices, warm, args, backend.name, counters, masks)


def engine_config(args: argparse.Namespace):
    """The EngineConfig a started server would have: ``tokenserve serve`` with the same
    ``--dtype``, ``--device``, ``--model`` and ``--server-args`` (quantization, batch size).

    Raises:
        ValueError: the flags do not make a valid serve configuration.
    """
    from tokenserve.config.flags import add_serve_flags, serve_config

    argv = ["--dtype", args.dtype, "--device", args.device,
            *(["--model", args.model] if args.model else []), *shlex.split(args.server_args)]
    parser = add_serve_flags(argparse.ArgumentParser(prog="tokenserve serve"))
    return serve_config(parser.parse_args(argv)).engine


async def run_engine(args: argparse.Namespace, slices: Sequence[Sequence[BenchRequest]],
                     warm: Sequence[BenchRequest]) -> list[LevelResult]:
    from tokenserve.engine.engine import AsyncEngine

    engine = await asyncio.to_thread(AsyncEngine.build, engine_config(args))
    await engine.start()
    ignore_eos = (args.ignore_eos if args.ignore_eos is not None
                  else get_backend(args.backend).ignore_eos)  # as the family would send it
    try:
        async def counters() -> tuple[int, int]:
            st = engine.stats()
            return st.num_draft_tokens, st.num_accepted_tokens

        async def masks() -> tuple[float, int]:
            st = engine.stats()
            return st.mask_ms, st.mask_steps

        return await sweep(lambda r: send_engine(engine, r, ignore_eos, args.response_format),
                           slices, warm, args, "engine", counters, masks)
    finally:
        await engine.stop()


def _llama_gguf(args: argparse.Namespace) -> str:
    """The GGUF a started llama-server loads (see ``--llamacpp-model``)."""
    if args.llamacpp_model:
        return args.llamacpp_model
    if args.model and str(args.model).endswith(".gguf"):
        return args.model
    if args.model:
        raise RuntimeError(f"--model {args.model} is not a .gguf; give llama-server one with "
                           "--llamacpp-model")
    from tokenserve.models.loader import default_gguf_path

    return str(default_gguf_path())


def _llama_server(args: argparse.Namespace, need_ctx: int) -> LlamaServer:
    """A llama-server with one slot per request in flight and room for the longest
    request in every slot."""
    slots = max(args.concurrency)
    return LlamaServer(args.llama_server, _llama_gguf(args), slots,
                       llama_server_ctx(slots, need_ctx), args.llama_server_args)


def _llama_props(url: str) -> dict[str, Any]:
    """What llama-server says about itself (``GET /props``): build, slots, context."""
    import httpx

    try:
        r = httpx.get(url + "/props", timeout=5.0)
        p = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        p = {}
    gen = p.get("default_generation_settings") or {}
    return {"build_info": p.get("build_info"), "model_path": p.get("model_path"),
            "model_ftype": p.get("model_ftype"),
            "total_slots": p.get("total_slots"), "n_ctx_per_slot": gen.get("n_ctx")}


def run_llamacpp(args: argparse.Namespace, slices: Sequence[Sequence[BenchRequest]],
                 warm: Sequence[BenchRequest], need_ctx: int, tokenizer: Any
                 ) -> tuple[list[LevelResult], dict[str, Any]]:
    """The same slices through llama.cpp's ``/completion`` (a started ``--llama-server``
    or ``--llamacpp-url``); returns the levels and what ``meta.llamacpp`` records."""
    from tokenserve.transport.runtime import run as run_loop

    server = None
    try:
        if args.llamacpp_url:
            url, cmd = args.llamacpp_url.rstrip("/"), None
        else:
            server = _llama_server(args, need_ctx)
            server.start()
            url, cmd = server.url, shlex.join(server.cmd)
        meta = {"url": url, "command": cmd, **_llama_props(url)}
        slots = meta.get("total_slots")
        if isinstance(slots, int) and slots < max(args.concurrency):
            log.warning("llama-server has %d slots < concurrency %d: requests queue inside it",
                        slots, max(args.concurrency))
        levels = run_loop(run_http(args, url, "llamacpp", tokenizer, slices, warm,
                                   backend_name="llamacpp"))
    finally:
        rss = server.stop() if server is not None else None
    if server is not None:
        meta["peak_rss_mib"] = rss
    return levels, meta


def run_baseline(args: argparse.Namespace, model_dir: Any,
                 slices: Sequence[Sequence[BenchRequest]],
                 warm: Sequence[BenchRequest]) -> list[LevelResult]:
    from tokenserve.loadgen.baseline_hf import HfBaseline

    hf = HfBaseline(model_dir, args.dtype, args.device)
    out = []
    for c, reqs in zip(args.concurrency, slices):
        hf.warmup(warm)
        bar = _progress(len(reqs), f"hf c={c}", args.no_progress)
        try:
            recs, duration = hf.run(reqs, c, max_duration_s=args.max_duration_s,
                                    progress=bar.update)
        finally:
            bar.close()
        out.append(LevelResult(c, recs, duration))
    return out


def _ignore_eos(args: argparse.Namespace) -> bool:
    """Whether the requests asked to ignore EOS (what the target was sent)."""
    return args.ignore_eos if args.ignore_eos is not None else get_backend(args.backend).ignore_eos


def _meta(args: argparse.Namespace, argv: Sequence[str], mode: str, url: str | None,
          model_dir: Any, model_name: str) -> dict[str, Any]:
    import torch

    import tokenserve

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "tokenserve bench " + shlex.join(argv),
        "mode": mode, "backend": args.backend if mode == "http" else "engine",
        "url": url, "model": model_name, "model_dir": str(model_dir), "dtype": args.dtype,
        "device": args.device, "dataset": args.dataset, "input_len": args.input_len,
        "output_len": args.output_len, "shared_prefix_len": args.shared_prefix_len,
        "long_input_len": args.long_input_len, "long_fraction": args.long_fraction,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "seed": args.seed, "warmup": args.warmup, "max_duration_s": args.max_duration_s,
        "baseline": args.baseline, "ignore_eos": _ignore_eos(args),
        "response_format": args.response_format,
        "system": "llamacpp" if args.backend == "llamacpp" else "ours",
        "cpu": cpu_summary(),
        "llamacpp": None, "cpus": os.cpu_count(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": tf_version,
        "tokenserve": getattr(tokenserve, "__version__", None),
    }


def assemble(args: argparse.Namespace, meta: dict[str, Any], ours: Sequence[LevelResult],
             base: Sequence[LevelResult] | None,
             llama: Sequence[LevelResult] | None = None) -> dict[str, Any]:
    """The results document (what ``--out`` writes). ``ours`` is the target (llama.cpp
    itself with ``--backend llamacpp``: ``meta.system`` says which); ``baseline`` the hf
    run; a level gets ``llamacpp``, ``ratio_llamacpp`` (ours/llamacpp) and
    ``records.llamacpp`` only when llama.cpp ran as the second baseline, and
    ``spec_decode`` (``draft_tokens``, ``accepted_tokens``, ``acceptance``) only when the
    target drafted tokens at some level (speculative decoding on)."""
    slo = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    levels = []
    drafting = any(res.spec and res.spec[0] for res in ours)  # else no spec_decode key
    for k, res in enumerate(ours):
        s_ours = summarize(res.records, res.duration_s, **slo)
        level: dict[str, Any] = {"concurrency": res.concurrency,
                                 "num_prompts": len(res.records), "ours": s_ours,
                                 "baseline": None, "ratio": None,
                                 "records": {"ours": [r.to_json() for r in res.records]}}
        if res.mask is not None and res.mask[1]:
            ms, steps = res.mask
            level["structured_output"] = {"mask_ms": round(ms, 3), "mask_steps": steps,
                                          "mask_ms_per_step": round(ms / steps, 4)}
        if drafting and res.spec is not None:
            drafted, accepted = res.spec
            level["spec_decode"] = {"draft_tokens": drafted, "accepted_tokens": accepted,
                                    "acceptance": accepted / drafted if drafted else None}
        # the baselines that ran: their summary, ours / theirs, their records
        for key, ratio_key, runs in (("baseline", "ratio", base),
                                     ("llamacpp", "ratio_llamacpp", llama)):
            if runs is None:
                continue
            other = runs[k]
            s_other = summarize(other.records, other.duration_s, **slo)
            level[key] = s_other
            level[ratio_key] = compare(s_ours, s_other)
            level["records"][key] = [r.to_json() for r in other.records]
        levels.append(level)
    return {"meta": meta, "levels": levels}


# --------------------------------------------------------------------------- entry point


def _check_deps(args: argparse.Namespace) -> None:
    """Fail before the run, not after it, when an optional dependency is missing."""
    needed = ["aiohttp", "httpx"] if not args.engine_only else []
    needed += ["transformers"] if args.baseline == "hf" else []
    needed += ["matplotlib"] if args.plot_dir else []
    missing = []
    for name in needed:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SystemExit(f"tokenserve bench: missing {', '.join(missing)}; install the "
                         "`bench` extra (pip install -e '.[bench]')")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    _check_deps(args)
    if args.llama_server:
        try:  # fail now, not after ours has run
            _llama_gguf(args)
        except (RuntimeError, FileNotFoundError) as exc:
            print(f"tokenserve bench: {exc}", file=sys.stderr)
            return 2
    from tokenserve.loadgen import report
    from tokenserve.models.loader import load_config, resolve_model
    from tokenserve.models.tokenizer import Tokenizer
    from tokenserve.transport.runtime import run as run_loop

    model_dir = resolve_model(args.model)
    tokenizer = Tokenizer(model_dir)
    local_name = load_config(model_dir).name
    counts = args.num_prompts * len(args.concurrency) if len(args.num_prompts) == 1 \
        else args.num_prompts
    words = word_ids(tokenizer)
    wl = build_workload(tokenizer, WorkloadConfig(
        sum(counts), args.input_len, args.output_len, args.dataset, args.shared_prefix_len,
        args.seed, args.long_input_len, args.long_fraction), words=words)
    slices, start = [], 0
    for n in counts:  # disjoint prompts per level: no prefix-cache hits across levels
        slices.append(wl[start:start + n])
        start += n
    warm = warmup_workload(tokenizer, args.warmup, words=words, seed=args.seed + 7919)

    server: ServerProcess | LlamaServer | None = None
    url = args.url.rstrip("/") if args.url else None
    mode = "engine" if args.engine_only else "http"
    model_name = args.served_model_name or local_name
    need_ctx = max(r.input_len for r in [*wl, *warm]) + max(r.output_len for r in [*wl, *warm])
    llama_meta: dict[str, Any] | None = None
    ours_rss: float | None = None
    try:
        if args.engine_only:
            ours = run_loop(run_engine(args, slices, warm))
        else:
            if url is None:
                if args.backend == "llamacpp":
                    server = _llama_server(args, need_ctx)
                    llama_meta = {"url": server.url, "command": shlex.join(server.cmd)}
                else:
                    server = ServerProcess(args)
                server.start()
                url = server.url
            if args.backend == "llamacpp":
                llama_meta = {**(llama_meta or {"url": url, "command": None}),
                              **_llama_props(url)}
            elif args.served_model_name is None:
                model_name = _served_model_name(url, local_name)
            ours = run_loop(run_http(args, url, model_name, tokenizer, slices, warm))
    except RuntimeError as exc:  # server did not start, warm-up failed, engine died
        print(f"tokenserve bench: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            ours_rss = server.stop()
            server = None
    llama, llama_failed = None, False
    if args.backend != "llamacpp" and (args.llama_server or args.llamacpp_url):
        try:  # second baseline: ours is stopped, so llama.cpp has the cores to itself
            llama, llama_meta = run_llamacpp(args, slices, warm, need_ctx, tokenizer)
        except RuntimeError as exc:  # report the others anyway; exit status 1
            print(f"tokenserve bench: llama.cpp: {exc}", file=sys.stderr)
            llama_failed = True
    base = run_baseline(args, model_dir, slices, warm) if args.baseline == "hf" else None

    meta = _meta(args, argv, mode, args.url or url, model_dir, model_name)
    meta["llamacpp"] = llama_meta
    meta["peak_rss_mib"] = ours_rss
    results = assemble(args, meta, ours, base, llama)
    print(report.format_table(results))
    if args.out:
        report.write_json(results, args.out)
        print(f"wrote {args.out}")
    if args.plot_dir:
        for path in report.plot(results, args.plot_dir):
            print(f"wrote {path}")
    failed = sum(lv[k]["failed"] for lv in results["levels"]
                 for k in ("ours", "baseline", "llamacpp") if lv.get(k) is not None)
    return 1 if failed or llama_failed else 0
