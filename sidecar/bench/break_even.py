"""``kv-sidecar bench break-even``: from an interference results file, after how many output tokens a
converted request has paid for its conversion; and the README tables, generated (never typed).

Savings per decode step from shuffled pages (the RFC's MI300X numbers) come from ``SAVINGS``; the low and
the high end are both used. Source: issue 13 quotes the RFC as "0.6–2.7 ms saved per step at batch 32–64
on MI300X"; no per-model table with those numbers was found in the design documents. Replace
``--savings`` with such a table when it is found.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from sidecar.bench.interference_stats import break_even_tokens

# (label, saved ms per step, batch) -- the two ends of the RFC's range as issue 13 quotes it
SAVINGS = [("RFC low: 0.6 ms/step @ batch 32", 0.6, 32), ("RFC high: 2.7 ms/step @ batch 64", 2.7, 64)]
SAVINGS_SOURCE = "issue 13 (quoting the RFC, MI300X): 0.6-2.7 ms saved per step at batch 32-64"


def _fmt(v: float, nd: int = 3) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def markdown_table(result: dict[str, Any]) -> str:
    """The operator table: per setting, context and rate, the decode step against no conversions."""
    rows = ["| setting | MPS | context | conv/s | step p50 ms (x base) | step p99 ms (x base) | step max ms "
            "| collided steps | conversion e2e p50 / p99 ms |", "|" + "---|" * 9]
    for g in result["groups"]:
        if "skipped" in g or "baseline" not in g:
            why = g.get("skipped") or g.get("error", "no baseline")
            rows.append(f"| {', '.join(g['settings'])} | skipped: {why} |||||||| ")
            continue
        b = g["baseline"]
        mps = f"{g['mps_percent']}%" if g["mps"] and g["mps_percent"] else ("on" if g["mps"] else "off")
        rows.append(f"| (no conversions) | {mps} | - | 0 | {_fmt(b['p50'])} | {_fmt(b['p99'])} "
                    f"| {_fmt(b['max'])} | - | - |")
        for p in g["phases"]:
            s, e = p["step"], p["conversion_e2e"]
            rows.append(f"| {p['setting']} | {mps} | {p['context']} | {p['rate']:g} | {_fmt(s['p50'])} "
                        f"(x{_fmt(p['step_p50_ratio'])}) | {_fmt(s['p99'])} (x{_fmt(p['step_p99_ratio'])}) "
                        f"| {_fmt(s['max'])} | {p['collided']['count']}/{s['n']} | {_fmt(e['p50'])} / "
                        f"{_fmt(e['p99'])} |")
    return "\n".join(rows)


def break_even_rows(result: dict[str, Any], savings: list[tuple[str, float, int]] = SAVINGS) -> list[dict]:
    """Per (setting, context): kernel ms alone, interference ms per conversion (median over the rates),
    and the break-even output tokens for each savings entry."""
    rows = []
    for g in result["groups"]:
        for name in g.get("settings", []):
            if "skipped" in g:
                continue
            for ctx, kernel in sorted(g.get("alone_ms", {}).get(name, {}).items(), key=lambda kv: int(kv[0])):
                inter = sorted(p["interference_ms_per_conversion"] for p in g["phases"]
                               if p["setting"] == name and p["context"] == int(ctx) and p["conversions"])
                med = inter[len(inter) // 2] if inter else math.nan
                row = {"setting": name, "mps": g["mps"], "context": int(ctx), "kernel_ms": kernel,
                       "interference_ms": med, "break_even": {}}
                for label, saved, batch in savings:
                    i = 0.0 if math.isnan(med) else med
                    row["break_even"][label] = break_even_tokens(kernel, i, saved, batch)
                rows.append(row)
    return rows


def break_even_markdown(rows: list[dict], savings: list[tuple[str, float, int]] = SAVINGS) -> str:
    head = "| setting | context | conversion GPU ms | interference ms / conversion | " + " | ".join(
        f"break-even tokens ({lab})" for lab, _, _ in savings) + " |"
    out = [head, "|" + "---|" * (4 + len(savings))]
    for r in rows:
        out.append(f"| {r['setting']} | {r['context']} | {_fmt(r['kernel_ms'])} "
                   f"| {_fmt(r['interference_ms'])} | "
                   + " | ".join(f"{r['break_even'][lab]:.1f}" for lab, _, _ in savings) + " |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, savings: list[tuple[str, float, int]] = SAVINGS) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['setting']}\n{r['context']}" for r in rows]
    w = 0.8 / max(1, len(savings))
    for k, (lab, _, _) in enumerate(savings):
        ax.bar([i + k * w for i in range(len(rows))], [r["break_even"][lab] for r in rows], w, label=lab)
    ax.set_xticks([i + w * (len(savings) - 1) / 2 for i in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("output tokens to break even")
    ax.set_title("converting pays off after this many output tokens")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kv-sidecar bench break-even", description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path, help="interference.json")
    p.add_argument("--out", type=Path, default=None,
                   help="directory for break-even.json/.png (default: beside)")
    args = p.parse_args(argv)
    result = json.loads(args.results.read_text())
    out = args.out or args.results.parent
    out.mkdir(parents=True, exist_ok=True)
    rows = break_even_rows(result)
    (out / "break-even.json").write_text(json.dumps({"source_results": str(args.results),
                                                     "savings_source": SAVINGS_SOURCE, "savings": SAVINGS,
                                                     "rows": rows}, indent=1))
    plot(rows, out / "break-even.png")
    print(break_even_markdown(rows))
    print(f"savings: {SAVINGS_SOURCE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
