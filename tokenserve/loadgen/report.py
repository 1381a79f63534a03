"""Report a results document (:func:`tokenserve.loadgen.serving.assemble`): a table on
stdout, the JSON file, and PNG plots (latency CDFs; throughput and TTFT against
concurrency)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _dist(d: dict[str, Any], keys: Sequence[str] = ("mean", "p50", "p99")) -> str:
    return "/".join(_f(d[k]) for k in keys)


_HEAD = ("c", "system", "ok/n", "req/s", "out tok/s", "TTFT ms mean/p50/p99",
         "TPOT ms mean/p50/p99", "ITL ms p50/p99", "E2E ms mean/p99", "out tok", "goodput")


def _row(c: int, name: str, s: dict[str, Any]) -> tuple[str, ...]:
    mean_out = s["total_output_tokens"] / s["completed"] if s["completed"] else None
    return (str(c), name, f"{s['completed']}/{s['num_requests']}",
            _f(s["request_throughput"], 2), _f(s["output_throughput"]), _dist(s["ttft_ms"]),
            _dist(s["tpot_ms"]), _dist(s["itl_ms"], ("p50", "p99")),
            _dist(s["e2e_ms"], ("mean", "p99")), _f(mean_out), _f(s["goodput"], 2))


def _ratio_row(c: int, r: dict[str, Any], label: str = "ours/hf") -> tuple[str, ...]:
    x = lambda v: "-" if v is None else f"x{v:.2f}"
    return (str(c), label, "", x(r["request_throughput"]), x(r["output_throughput"]),
            x(r["ttft_mean"]) + " (mean)", x(r["tpot_mean"]) + " (mean)", "",
            x(r["e2e_mean"]) + " (mean)", "", "")


#: (level and records key, row label) of the systems besides the target, in row order
_OTHERS = (("baseline", "hf"), ("llamacpp", "llamacpp"))


def short_counts(records: Sequence[dict[str, Any]]) -> int:
    """Completed requests whose output length differs from the one asked for (an EOS
    where ignore_eos was not sent, or a server that does not honour it)."""
    return sum(1 for r in records if r["ok"] and r["output_tokens"] != r["target_output_len"])


def format_table(results: dict[str, Any]) -> str:
    """A fixed-width table: one row per (level, system) and a ratio row per level and
    baseline (``ours/hf``, ``ours/llamacpp``; the target is named ``llamacpp`` when it is
    llama.cpp itself)."""
    m = results["meta"]
    target = m.get("system", "ours")
    system = "engine (no HTTP)" if m["mode"] == "engine" else f"{m['backend']} over HTTP"
    title = (f"tokenserve bench: {system}; {m['model']} {m['dtype']}; {m['dataset']} "
             f"{m['input_len']} in / {m['output_len']} out; rate {m['request_rate']}; "
             f"{m['cpus']} CPUs; {m['date']}")
    rows = [_HEAD]
    for lv in results["levels"]:
        c = lv["concurrency"]
        rows.append(_row(c, target, lv["ours"]))
        others = [(label, key) for key, label in _OTHERS if lv.get(key) is not None]
        for label, key in others:
            rows.append(_row(c, label, lv[key]))
        for label, key in others:
            rows.append(_ratio_row(c, lv["ratio" if key == "baseline" else f"ratio_{key}"],
                                   f"{target}/{label}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEAD))]
    lines = [title]
    for k, r in enumerate(rows):
        lines.append("  ".join(v.rjust(w) if i != 1 else v.ljust(w)
                               for i, (v, w) in enumerate(zip(r, widths))).rstrip())
        if k == 0:
            lines.append("-" * len(lines[-1]))
    slo = results["levels"][0]["ours"]["slo"] if results["levels"] else {}
    limits = [f"{k[:-3]}<={v} ms" for k, v in slo.items() if v is not None]
    notes = [f"goodput = req/s meeting SLO {', '.join(limits)}" if limits
             else "goodput: '-' (no --slo-ttft-ms/--slo-tpot-ms)"]
    present = [label for key, label in _OTHERS
               if any(lv.get(key) is not None for lv in results["levels"])]
    if present:
        notes.append(f"{', '.join(f'{target}/{o}' for o in present)}: throughput > 1 and "
                     f"latency < 1 favour {target}")
    sources = sorted({s for lv in results["levels"] for key in ("ours", "llamacpp")
                      if lv.get(key) is not None for s in lv[key]["token_sources"]})
    notes.append(f"tokens counted from responses ({', '.join(sources)})")
    if "ignore_eos" in m:
        notes.append(f"ignore_eos {'sent' if m['ignore_eos'] else 'not sent'}")
    lines.append("; ".join(notes))
    if m.get("cpu"):
        lines.append(f"CPU: {m['cpu']}")
    pre = [f"c={lv['concurrency']} " + "/".join(
        f"{lv[k]['prefill_tok_s']['mean']:.0f}" for k in ("ours", "llamacpp")
        if lv.get(k) is not None and (lv[k].get("prefill_tok_s") or {}).get("mean") is not None)
        for lv in results["levels"]]
    if pre:
        who = target + ("/llamacpp" if any(lv.get("llamacpp") for lv in results["levels"])
                        else "")
        lines.append(f"prefill tok/s (prompt tokens / TTFT, mean; {who}): " + ", ".join(pre))
    rss = [(target, m.get("peak_rss_mib")), ("llamacpp", (m.get("llamacpp") or {}).get(
        "peak_rss_mib"))]
    if any(v is not None for _, v in rss):
        lines.append("peak RSS: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in rss if v is not None))
    lc = m.get("llamacpp")
    if lc:
        what = lc.get("command") or lc.get("url")
        lines.append(f"llama.cpp: {what}; build {lc.get('build_info') or '?'}, "
                     f"weights {lc.get('model_ftype') or '?'}, "
                     f"{lc.get('total_slots') or '?'} slots x {lc.get('n_ctx_per_slot') or '?'}"
                     " tokens")
    spec = [f"c={lv['concurrency']} {sd['accepted_tokens']}/{sd['draft_tokens']}"
            + (f" ({sd['acceptance']:.0%})" if sd["acceptance"] is not None else "")
            for lv in results["levels"] if (sd := lv.get("spec_decode")) is not None]
    if any(lv["spec_decode"]["draft_tokens"] for lv in results["levels"]
           if lv.get("spec_decode")):
        lines.append("speculative decoding, accepted/drafted tokens: " + ", ".join(spec))
    masks = [f"c={lv['concurrency']} {so['mask_ms_per_step']:.3f} ms/step over "
             f"{so['mask_steps']} steps" for lv in results["levels"]
             if (so := lv.get("structured_output")) is not None]
    if m.get("response_format", "text") != "text" or masks:
        lines.append(f"response_format {m.get('response_format')}; structured-output mask "
                     f"cost: {', '.join(masks) or 'not reported'}")
    names = {"ours": target, "baseline": "hf", "llamacpp": "llamacpp"}
    for lv in results["levels"]:
        for key, name in names.items():
            s = lv.get(key)
            if s is not None and s["failed"]:
                lines.append(f"c={lv['concurrency']} {name}: {s['failed']} failed: "
                             f"{'; '.join(s['errors'])}")
            recs = lv["records"].get(key)
            n_short = short_counts(recs) if recs else 0
            if n_short:
                lines.append(f"c={lv['concurrency']} {name}: {n_short} of {len(recs)} requests "
                             "returned another output length than asked for (EOS without "
                             "ignore_eos?)")
    return "\n".join(lines)


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, list):
        return [_round(v) for v in x]
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    return x


def dumps(results: dict[str, Any]) -> str:
    """Indented JSON, except one compact line per request record (seconds, 1 us)."""
    records: list[str] = []

    def mark(recs: list[dict[str, Any]]) -> list[str]:
        out = []
        for r in recs:
            records.append(json.dumps(_round(r), separators=(",", ":")))
            out.append(f"@@record{len(records) - 1}@@")
        return out

    doc = {**results, "levels": [
        {**lv, "records": {k: mark(v) for k, v in lv["records"].items()}}
        for lv in results["levels"]]}
    text = json.dumps(doc, indent=1)
    for i, rec in enumerate(records):
        text = text.replace(f'"@@record{i}@@"', rec, 1)
    return text + "\n"


def write_json(results: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(results), encoding="utf-8")


# --------------------------------------------------------------------------- plots


def _ms_values(records: Sequence[dict[str, Any]], metric: str) -> list[float]:
    out = []
    for r in records:
        if not r["ok"]:
            continue
        if metric == "ttft" and r["ttft"] is not None:
            out.append(r["ttft"] * 1e3)
        elif metric == "e2e":
            out.append(r["e2e"] * 1e3)
        elif metric == "tpot" and r["ttft"] is not None and r["output_tokens"] > 1:
            out.append((r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) * 1e3)
    return out


def plot(results: dict[str, Any], plot_dir: str | Path) -> list[Path]:
    """Write ``latency_cdf.png`` and, for a sweep, ``throughput_vs_concurrency.png`` and
    ``ttft_vs_concurrency.png``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    levels = results["levels"]
    written = []
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = {"ours": results["meta"].get("system", "ours"), "baseline": "hf",
             "llamacpp": "llamacpp"}

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, metric, title in zip(axes, ("ttft", "tpot", "e2e"),
                                 ("TTFT", "TPOT (excl. first token)", "E2E latency")):
        for k, lv in enumerate(levels):
            color = colors[k % len(colors)]
            for system, style in (("ours", "-"), ("baseline", "--"), ("llamacpp", ":")):
                recs = lv["records"].get(system)
                vals = np.sort(_ms_values(recs, metric)) if recs else np.array([])
                if vals.size:
                    x = np.concatenate([vals[:1], vals])
                    y = np.arange(0, vals.size + 1) / vals.size
                    label = f"{names[system]} c={lv['concurrency']}"
                    ax.step(x, y, style, where="post", color=color, label=label)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(_subtitle(results))
    fig.tight_layout()
    written.append(_save(fig, plot_dir / "latency_cdf.png"))
    plt.close(fig)

    cs = [lv["concurrency"] for lv in levels]
    has = {key: all(lv.get(key) is not None for lv in levels)
           for key in ("ours", "baseline", "llamacpp")}
    for name, key, ylabel, stats in (
            ("throughput_vs_concurrency.png", "output_throughput", "output tokens/s", None),
            ("ttft_vs_concurrency.png", "ttft_ms", "TTFT ms", ("p50", "p99"))):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for system, marker, color in (("ours", "o", colors[0]), ("baseline", "s", colors[1]),
                                      ("llamacpp", "^", colors[2])):
            if not has[system]:
                continue
            label = "hf generate" if system == "baseline" else names[system]
            if stats is None:
                ax.plot(cs, [lv[system][key] for lv in levels], marker=marker, color=color,
                        label=label)
            else:
                for st, style in zip(stats, ("-", ":")):
                    ax.plot(cs, [lv[system][key][st] or np.nan for lv in levels], style,
                            marker=marker, color=color, label=f"{label} {st}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        if stats is not None:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(_subtitle(results), fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, plot_dir / name))
        plt.close(fig)
    return written


def _subtitle(results: dict[str, Any]) -> str:
    m = results["meta"]
    system = "engine" if m["mode"] == "engine" else m["backend"]
    return (f"{system}, {m['model']} {m['dtype']}, {m['input_len']} in / {m['output_len']} out, "
            f"{m['cpus']} CPUs")


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    return path
