"""`dion3 plan`'s model against every optimizer-step measurement in benchmarks/results.

Usage: PYTHONPATH=src python benchmarks/plan_validation.py [--out PREFIX]

Three code states were measured: the single-device step table at 6b0e2bf (2026-12-01) and the
distributed records of 2026-11-29 (FSDP2 on one H200 at 502c714, on two at 0d0a9f3), whose
kernels were 10-20% slower than at 6b0e2bf. Each record gets its own two sustained rates, each
fitted to ONE measurement (Llama-8B Muon + Gram + kernels fixes the rate of orthogonalization on
dion3's kernels; Llama-8B Muon baseline the rate of standard NS on cuBLAS); the memory-pass bandwidth is
the measured 4.3 TB/s (not fitted) and the NVLink rate an assumption (360 GB/s per direction).
Every other row is predicted. Bytes per rank are predicted from the planner and compared to the
optimizer's own count.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "src"))  # after PYTHONPATH: an installed dion3 wins

from dion3.bench.presets import MODELS  # noqa: E402
from dion3.plan.cost import Hardware, Network, Variant  # noqa: E402
from dion3.plan.run import build_plans, price  # noqa: E402
from dion3.plan.world import model_weights, parse_layout  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MEMORY = 4.3e12  # measured device copy rate (bench.flops.H200_COPY_BYTES_PER_S)
NVLINK = 360e9


def variants() -> dict[str, Variant]:
    out = {"muon-baseline": Variant("Muon baseline", "muon", orthogonalizer="newton_schulz", symmetric=False),
           "muon": Variant("Muon + Gram + kernels", "muon"), "normuon": Variant("NorMuon", "normuon")}
    for f, text in ((0.5, "1/2"), (0.25, "1/4"), (0.125, "1/8")):
        out[f"dion3-{text} local"] = Variant(f"Dion3 f={text} local", "dion3", f)
        out[f"dion3-{text} global"] = Variant(f"Dion3 f={text} global", "dion3", f, "global")
    return out


def measurements() -> list[dict]:
    """(record, preset, layout, variant key, measured ms, measured bytes or None)."""
    rows = []
    single = json.loads((RESULTS / "step-h200-2026-12-01-6b0e2bf.json").read_text())["runs"]
    names = {"muon": "muon-baseline", "muon-gram": "muon", "normuon": "normuon", "dion3-1/2": "dion3-1/2 local",
             "dion3-1/4": "dion3-1/4 local", "dion3-1/8": "dion3-1/8 local"}
    for key, preset in (("8b", "llama-8b"), ("1b", "llama-1b"), ("70b", "llama-70b-slice")):
        best: dict[str, float] = {}
        for r in single[key]["results"]:
            if r["name"] in names and r.get("device_ms"):
                best[r["name"]] = min(best.get(r["name"], float("inf")), r["device_ms"])
        rows += [dict(record="one H200, 6b0e2bf", era="single", preset=preset, layout="single", variant=names[n], ms=ms,
                      bytes=None) for n, ms in best.items()]
    for path, layout, label in (("distributed-step-1xh200-2026-11-29.json", "fsdp=1", "FSDP2 1×H200, 502c714"),
                                ("distributed-step-2xh200-2026-11-29.json", "fsdp=2", "FSDP2 2×H200, 0d0a9f3")):
        data = json.loads((RESULTS / path).read_text())
        for preset, run in data.items():
            for t in run["timing"]:
                if t["variant"] == "adamw":
                    continue
                rows.append(dict(record=label, era=layout, preset=preset, layout=layout, variant=t["variant"],
                                 ms=t["step_ms"], bytes=t.get("bytes_sent") or None))
    return rows


# Per record (each is one code state), fitted: the rate of orthogonalization on dion3's kernels
# and, for the distributed step, a fixed time per bucket (launches, host syncs, small copies),
# together from Muon + Gram + kernels on Llama-8B and Llama-1B (one device: the rate from
# Llama-8B alone, no fixed time); the rate of standard NS on cuBLAS from Llama-8B's Muon baseline.
FITS = {"single": {"symmetric": [("llama-8b", "single", "muon")], "dense": ("llama-8b", "single", "muon-baseline")}}
FITS.update({layout: {"symmetric": [("llama-8b", layout, "muon"), ("llama-1b", layout, "muon")],
                      "dense": ("llama-8b", layout, "muon-baseline")} for layout in ("fsdp=1", "fsdp=2")})


def fit(rows: list[dict], priced: dict, fits: dict) -> dict:
    """Solve measured = memory + FLOPs / rate + buckets · overhead for 1/rate and overhead."""
    measured = {(r["preset"], r["layout"], r["variant"]): r["ms"] / 1e3 for r in rows}
    keys = fits["symmetric"]
    if len(keys) == 1:
        p = priced[keys[0]]
        inverse, overhead = (measured[keys[0]] - p["memory_s"]) / p["flops"], 0.0
    else:
        (a, b), (c, d) = [(priced[k]["flops"], priced[k]["buckets"]) for k in keys]
        y1, y2 = [measured[k] - priced[k]["memory_s"] for k in keys]
        det = a * d - b * c
        inverse, overhead = (y1 * d - b * y2) / det, (a * y2 - c * y1) / det
    p = priced[fits["dense"]]
    dense = p["flops"] / (measured[fits["dense"]] - p["memory_s"] - p["buckets"] * overhead)
    return dict(symmetric=1 / inverse, dense=dense, overhead=overhead)


def main(argv=None) -> int:
    args = _args(argv)
    rows = measurements()
    vs = variants()
    unit = Hardware("unit", 1.0, 1.0, MEMORY, 141e9)  # FLOPs come out as seconds at 1 FLOP/s
    net = Network(nvlink=NVLINK)
    priced: dict[tuple, dict] = {}
    for preset, layout in sorted({(r["preset"], r["layout"]) for r in rows}):
        wanted = sorted({r["variant"] for r in rows if (r["preset"], r["layout"]) == (preset, layout)})
        model = MODELS[preset]
        chosen = [vs[w] for w in wanted]
        planned = build_plans(model_weights(model.matrices), parse_layout(layout), chosen)
        steps = price(planned, chosen, unit, net)
        for w in wanted:
            s = steps[vs[w].label]
            priced[(preset, layout, w)] = dict(
                flops=s.worst(lambda c: c.executed_flops), memory_s=s.worst(lambda c: c.memory_s),
                comm_s=s.communication_s, sent=s.worst(lambda c: c.total_sent),
                buckets=sum(1 for b in planned.plans[vs[w].label] if b.kind != "local"))
    rates = {era: fit(rows, priced, fits) for era, fits in FITS.items()}
    out = []
    for r in rows:
        p = priced[(r["preset"], r["layout"], r["variant"])]
        kind = "dense" if r["variant"] == "muon-baseline" else "symmetric"
        compute = p["flops"] / rates[r["era"]][kind]
        overhead = p["buckets"] * rates[r["era"]]["overhead"]
        predicted = (p["memory_s"] + max(compute, p["comm_s"]) + overhead) * 1e3
        fits = FITS[r["era"]]
        fitted = (r["preset"], r["layout"], r["variant"]) in [*fits["symmetric"], fits["dense"]]
        out.append(dict(r, predicted_ms=predicted, error=predicted / r["ms"] - 1, fitted=fitted,
                        predicted_bytes=p["sent"]))
    report = markdown(out, rates) + "\n\n" + memory_table(memory_rows(vs))
    print(report)
    if args.out:
        Path(args.out + ".md").write_text(report + "\n")
        Path(args.out + ".json").write_text(json.dumps(dict(rates=rates, rows=out), indent=1) + "\n")
    return 0


def memory_rows(vs: dict) -> list[dict]:
    """Peak memory of the single-device step (matrices only: parameters, gradients, state and
    the step's buffers) against the planner's params + grads + state + transient."""
    single = json.loads((RESULTS / "step-h200-2026-12-01-6b0e2bf.json").read_text())["runs"]
    names = {"muon": "muon-baseline", "muon-gram": "muon", "normuon": "normuon", "dion3-1/2": "dion3-1/2 local",
             "dion3-1/4": "dion3-1/4 local", "dion3-1/8": "dion3-1/8 local"}
    out = []
    for key, preset in (("8b", "llama-8b"), ("1b", "llama-1b"), ("70b", "llama-70b-slice")):
        peaks = {names[r["name"]]: r["peak_gb"] for r in single[key]["results"]
                 if r["name"] in names and r.get("peak_gb") and r["mode"] == "eager"}
        chosen = [vs[k] for k in peaks]
        planned = build_plans(model_weights(MODELS[preset].matrices), parse_layout("single"), chosen)
        steps = price(planned, chosen, Hardware("h200", 1.0, 1.0, MEMORY, 141e9), Network())
        for k, peak in peaks.items():
            c = steps[vs[k].label].ranks[0]
            predicted = (c.params + c.grads + c.state + c.transient) / 1e9
            out.append(dict(preset=preset, variant=k, measured_gb=peak, predicted_gb=predicted,
                            error=predicted / peak - 1))
    return out


def memory_table(rows: list[dict]) -> str:
    lines = ["| preset | variant | measured peak GB | predicted GB | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['preset']} | {r['variant']} | {r['measured_gb']:.1f} | {r['predicted_gb']:.1f} | "
              f"{r['error'] * 100:+.1f}% |" for r in rows]
    return "\n".join(lines)


def _args(argv):
    p = argparse.ArgumentParser(description="dion3 plan's model against the step measurements")
    p.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    return p.parse_args(argv)


def markdown(rows: list[dict], rates: dict) -> str:
    lines = ["| record | preset | variant | measured ms | predicted ms | error | MB sent/rank measured | predicted |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tag = " (fitted)" if r["fitted"] else ""
        sent = "—" if r["bytes"] is None else f"{r['bytes'] / 1e6:.1f}"
        psent = "—" if r["bytes"] is None else f"{r['predicted_bytes'] / 1e6:.1f}"
        lines.append(f"| {r['record']} | {r['preset']} | {r['variant']}{tag} | {r['ms']:.1f} | {r['predicted_ms']:.1f} | "
                     f"{r['error'] * 100:+.1f}% | {sent} | {psent} |")
    held = [r for r in rows if not r["fitted"]]
    within = sum(abs(r["error"]) <= 0.15 for r in held)
    lines += ["", f"Held out: {within} of {len(held)} within 15%. Rates (TFLOP/s of executed FLOPs): " + "; ".join(
        f"{e}: kernels {v['symmetric'] / 1e12:.0f}, cuBLAS NS {v['dense'] / 1e12:.0f}, per bucket "
        f"{v['overhead'] * 1e3:.2f} ms" for e, v in rates.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
