"""`dion3 plan`'s model against every optimizer-step measurement in benchmarks/results.

Usage: PYTHONPATH=src python benchmarks/plan_validation.py [--out PREFIX]
       PYTHONPATH=src python benchmarks/plan_validation.py --whole-steps   # the whole-step model (below)

Five code states were measured: the single-device step table at 6b0e2bf (2026-12-01), the
distributed records of 2026-11-29 (FSDP2 on one H200 at 502c714, on two at 0d0a9f3), whose
kernels were 10-20% slower than at 6b0e2bf, and the A/B record of 2026-12-02 (FSDP2 on one H200,
the pipeline of 12e833a and the one before it, two runs each). Each record gets its own
constants, fitted to named rows only (FITS: Llama-8B and Llama-1B Muon + Gram + kernels fix the
rate of orthogonalization on dion3's kernels and, for the distributed records, the fixed device
time per bucket; Llama-8B's Muon baseline the rate of standard NS on cuBLAS); the memory-pass
bandwidth is the measured 4.3 TB/s, the NVLink rate an assumption (360 GB/s per direction), and
the host time per kernel launch of the distributed step is measured (step-host-time record;
the code before 160640b launched the momentum pass once per matrix: one launch more per matrix).
Every other row is predicted, with the host term and without it (its fit redone). Bytes per rank
are predicted from the planner and compared to the optimizer's own count.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "src"))  # after PYTHONPATH: an installed dion3 wins

from dion3.tools.bench.presets import MODELS  # noqa: E402
from dion3.tools.plan.pricing import Hardware, Network, Variant  # noqa: E402
from dion3.tools.plan.run import build_plans, price  # noqa: E402
from dion3.tools.plan.world import model_weights, parse_layout  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MEMORY = 4.3e12  # measured device copy rate (bench.flops.H200_COPY_BYTES_PER_S)
NVLINK = 360e9
HOST = "step-host-time-h200-2026-12-02.json"
# The distributed records' code read each gradient with its own launch of the momentum pass
# (before 160640b: 112 launches a step on Llama-1B): one launch more per matrix of a bucket.
PIECE_LAUNCHES = {"single": 0, "fsdp=1": 1, "fsdp=2": 1, "ab-new": 0, "ab-old": 0}


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
    distributed = json.loads((RESULTS / "distributed-step-h200-2026-11-29.json").read_text())
    for key, layout, label in (("distributed-step-1xh200-2026-11-29", "fsdp=1", "FSDP2 1×H200, 502c714"),
                               ("distributed-step-2xh200-2026-11-29", "fsdp=2", "FSDP2 2×H200, 0d0a9f3")):
        data = distributed[key]
        for preset, run in data.items():
            for t in run["timing"]:
                if t["variant"] == "adamw":
                    continue
                rows.append(dict(record=label, era=layout, preset=preset, layout=layout, variant=t["variant"],
                                 ms=t["step_ms"], bytes=t.get("bytes_sent") or None))
    # FSDP2 at one rank, one pipeline (12e833a, "new") and the two before it ("old"), two runs each
    ab = json.loads((RESULTS / "distributed-ab-h200-2026-12-02.json").read_text())  # one entry per run
    for code, era, label in (("new", "ab-new", "FSDP2 1×H200, 12e833a"), ("old", "ab-old", "FSDP2 1×H200, d5c7f3b")):
        for preset in ("llama-1b", "llama-8b"):
            for run in (1, 2):
                data = ab[f"fsdp-{preset}-{code}-run{run}"]
                rows += [dict(record=f"{label} run {run}", era=era, preset=preset, layout="fsdp=1",
                              variant=t["variant"], ms=t["step_ms"], bytes=None) for t in data["timing"]]
    return rows


def launch_seconds(vs: dict) -> tuple[float, list[dict]]:
    """Host time per kernel launch of the distributed step: the step-host-time record's host time
    of each sync-free step of the code it measured last (b8cbb74, one H200), over the launches
    the planner counts for that step (cost.STAGE_LAUNCHES); the median over its rows."""
    probe = json.loads((RESULTS / HOST).read_text())["probe"]
    names = {"muon": "muon", "normuon": "normuon", "dion3-1/2 local": "dion3-1/2 local",
             "dion3-1/4 local": "dion3-1/4 local"}
    out = []
    for key in ("b8cbb74 llama-1b", "b8cbb74 llama-8b"):
        run = probe[key]
        chosen = [vs[names[r["variant"]]] for r in run["rows"] if r["host_ms"]]
        planned = build_plans(model_weights(MODELS[run["preset"]].matrices), parse_layout("fsdp=1"), chosen)
        counted = price(planned, chosen, Hardware("count", 1.0, 1.0, MEMORY, 141e9, launch_s=1.0), Network())
        for r in run["rows"]:
            if r["host_ms"]:
                launches = counted[vs[names[r["variant"]]].label].host_s
                out.append(dict(preset=run["preset"], variant=r["variant"], host_ms=r["host_ms"], launches=launches,
                                kernels=r["kernels"], per_launch_us=r["host_ms"] * 1e3 / launches))
    return statistics.median(r["per_launch_us"] for r in out) * 1e-6, out


# Per record (each is one code state), fitted: the rate of orthogonalization on dion3's kernels
# and, for the distributed step, a fixed device time per bucket (small copies and waits), together
# from Muon + Gram + kernels on Llama-8B and Llama-1B (one device: the rate from Llama-8B alone,
# no fixed time); the rate of standard NS on cuBLAS from Llama-8B's Muon baseline (where the
# record has one). Rows are (preset, layout, variant, record): the A/B record's Muon rows are in
# its first runs.
FITS = {"single": {"symmetric": [("llama-8b", "muon")], "dense": ("llama-8b", "muon-baseline")}}
FITS.update({era: {"symmetric": [("llama-8b", "muon"), ("llama-1b", "muon")], "dense": ("llama-8b", "muon-baseline")}
             for era in ("fsdp=1", "fsdp=2", "ab-new", "ab-old")})


def fit(rows: list[dict], priced, fits: dict, launch_s: float, piece_launches: int) -> dict:
    """Solve measured − waits = memory + FLOPs / rate + buckets · overhead for 1/rate and overhead
    (waits: the time the device waits for the host, which depends on the rates: the solution is
    iterated to a fixed point; 0 without the host term or on one device)."""
    measured: dict = {}
    for r in rows:  # the first run of a row (the A/B record's Muon rows are in its first runs)
        measured.setdefault((r["preset"], r["variant"]), r["ms"] / 1e3)
    keys = fits["symmetric"]
    rates = dict(symmetric=1.0, dense=1.0, overhead=0.0)
    for _ in range(50):
        p = {k: priced(k, rates, launch_s, piece_launches) for k in keys + [fits["dense"]] if k in measured}
        if len(keys) == 1:
            inverse = (measured[keys[0]] - p[keys[0]]["memory_s"] - p[keys[0]]["exposed_s"]) / p[keys[0]]["flops"]
            overhead = 0.0
        else:
            (a, b), (c, d) = [(p[k]["flops"], p[k]["buckets"]) for k in keys]
            y1, y2 = [measured[k] - p[k]["memory_s"] - p[k]["exposed_s"] for k in keys]
            det = a * d - b * c
            inverse, overhead = (y1 * d - b * y2) / det, (a * y2 - c * y1) / det
        dense = rates["dense"]
        if fits["dense"] in measured:
            q = p[fits["dense"]]
            dense = q["flops"] / (measured[fits["dense"]] - q["memory_s"] - q["buckets"] * overhead - q["exposed_s"])
        new = dict(symmetric=1 / inverse, dense=dense, overhead=overhead)
        done = all(abs(new[k] - rates[k]) <= 1e-9 * max(abs(new[k]), 1e-12) for k in new)
        rates = new
        if done:
            break
    return rates


STUDY_STEPS = RESULTS / "frontier" / "steps-h200.json"  # train_step reports of the study models (one H200)


def whole_steps() -> str:
    """`dion3 plan --tokens-per-step`'s whole step (6 · parameters · tokens at the default rate, plus
    the planned optimizer step, on one rank) against the whole steps train_step measured on the
    study models (compiled model, eager optimizer); also with each model's own rate, read off its
    AdamW step (what `--train-tflops` would be given), which leaves the optimizer's share to check."""
    from dion3.tools.plan.cli import GPUS, head_numel
    from dion3.tools.plan.run import setting_variant
    from dion3.tools.plan.time_to_loss import SETTINGS, forward_backward_seconds

    hw = Hardware("h200", GPUS["h200"]["symmetric"] * 1e12, GPUS["h200"]["dense"] * 1e12, MEMORY, 141e9)
    rate = GPUS["h200"]["train"] * 1e12
    lines = ["| model | setting | tokens a step | measured whole ms | modeled ms | error | own rate (TFLOP/s) | "
             "modeled ms | error | measured optimizer ms | planned ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for report in json.loads(STUDY_STEPS.read_text()):
        if "rows" not in report:
            continue
        preset = MODELS[report["model"]]
        parameters = preset.matrix_numel + head_numel(preset)
        rows = {r["setting"]: r for r in report["rows"] if r["mode"] == "eager"}
        tokens = round(rows["adamw"]["tokens_per_second"] * rows["adamw"]["total_ms"] / 1e3)
        own = 6 * parameters * tokens / ((rows["adamw"]["total_ms"] - rows["adamw"]["optimizer_ms"]) / 1e3)
        vs = [setting_variant(n) for n in SETTINGS if n in rows]
        steps = price(build_plans(model_weights(preset.matrices), parse_layout("single"), vs), vs, hw, Network())
        for v, name in zip(vs, [n for n in SETTINGS if n in rows]):
            planned = steps[v.label].critical_path_s(True)
            measured = rows[name]["total_ms"]
            modeled = (forward_backward_seconds(parameters, tokens, 1, rate) + planned) * 1e3
            mine = (forward_backward_seconds(parameters, tokens, 1, own) + planned) * 1e3
            lines.append(f"| {report['model']} | {name} | {tokens:,} | {measured:.1f} | {modeled:.1f} | "
                         f"{modeled / measured - 1:+.0%} | {own / 1e12:.0f} | {mine:.1f} | {mine / measured - 1:+.0%} | "
                         f"{rows[name]['optimizer_ms']:.1f} | {planned * 1e3:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _args(argv)
    if args.whole_steps:
        print(whole_steps())
        return 0
    rows = measurements()
    vs = variants()
    net = Network(nvlink=NVLINK)
    launch_s, launch_rows = launch_seconds(vs)
    plans = {}
    for preset, layout in sorted({(r["preset"], r["layout"]) for r in rows}):
        wanted = sorted({r["variant"] for r in rows if (r["preset"], r["layout"]) == (preset, layout)})
        plans[(preset, layout)] = (build_plans(model_weights(MODELS[preset].matrices), parse_layout(layout),
                                               [vs[w] for w in wanted]), wanted)

    def hardware(rates: dict, launch: float) -> Hardware:
        return Hardware("fit", rates["symmetric"], rates["dense"], MEMORY, 141e9,
                        bucket_overhead=rates["overhead"], launch_s=launch)

    def priced_in(layout):
        def priced(key, rates, launch, pieces):
            preset, w = key
            planned, _ = plans[(preset, layout)]
            s = price(planned, [vs[w]], hardware(rates, launch), net, piece_launches=pieces)[vs[w].label]
            unit = price(planned, [vs[w]], replace(hardware(rates, 0.0), symmetric_flops=1.0, dense_flops=1.0,
                                                   bucket_overhead=0.0), net)[vs[w].label]
            return dict(flops=unit.worst(lambda c: c.compute_s), memory_s=s.worst(lambda c: c.memory_s),
                        exposed_s=s.exposed_s, buckets=sum(1 for b in planned.plans[vs[w].label] if b.kind != "local"),
                        step=s)
        return priced

    eras = {}
    for era, fits in FITS.items():
        era_rows = [r for r in rows if r["era"] == era]
        layout, pieces = era_rows[0]["layout"], PIECE_LAUNCHES[era]
        host = launch_s if layout != "single" else 0.0
        eras[era] = dict(with_host=fit(era_rows, priced_in(layout), fits, host, pieces),
                         without=fit(era_rows, priced_in(layout), fits, 0.0, pieces), layout=layout,
                         piece_launches=pieces, launch_s=host)
    out = []
    for r in rows:
        e = eras[r["era"]]
        fits = FITS[r["era"]]
        priced = priced_in(e["layout"])
        key = (r["preset"], r["variant"])
        with_host = priced(key, e["with_host"], e["launch_s"], e["piece_launches"])["step"]
        without = priced(key, e["without"], 0.0, e["piece_launches"])["step"]
        predicted, before = with_host.critical_path_s(True) * 1e3, without.critical_path_s(True) * 1e3
        fitted = key in [*fits["symmetric"], fits["dense"]] and (r["era"] not in ("ab-new", "ab-old")
                                                                  or r["record"].endswith("run 1"))
        out.append(dict(r, predicted_ms=predicted, error=predicted / r["ms"] - 1, without_host_ms=before,
                        error_without_host=before / r["ms"] - 1, waits_ms=with_host.exposed_s * 1e3,
                        host_ms=with_host.host_s * 1e3, fitted=fitted,
                        predicted_bytes=with_host.worst(lambda c: c.total_sent)))
    rates = {era: dict(e["with_host"], launch_s=e["launch_s"], piece_launches=e["piece_launches"])
             for era, e in eras.items()}
    before = {era: e["without"] for era, e in eras.items()}
    report = (markdown(out, rates, before) + "\n\n" + launch_table(launch_rows, launch_s) + "\n\n"
              + memory_table(memory_rows(vs)))
    print(report)
    if args.out:
        Path(args.out + ".md").write_text(report + "\n")
        Path(args.out + ".json").write_text(json.dumps(dict(rates=rates, rates_without_host=before, launch=launch_rows,
                                                            rows=out), indent=1) + "\n")
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
    p.add_argument("--whole-steps", action="store_true",
                   help="instead: the modeled whole training steps against the study models' measured ones")
    return p.parse_args(argv)


def markdown(rows: list[dict], rates: dict, before: dict) -> str:
    lines = ["| record | preset | variant | measured ms | predicted ms | error | device waits for host ms | "
             "without host term ms | error | MB sent/rank measured | predicted |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tag = " (fitted)" if r["fitted"] else ""
        sent = "—" if r["bytes"] is None else f"{r['bytes'] / 1e6:.1f}"
        psent = "—" if r["bytes"] is None else f"{r['predicted_bytes'] / 1e6:.1f}"
        lines.append(f"| {r['record']} | {r['preset']} | {r['variant']}{tag} | {r['ms']:.1f} | {r['predicted_ms']:.1f} | "
                     f"{r['error'] * 100:+.1f}% | {r['waits_ms']:.1f} | {r['without_host_ms']:.1f} | "
                     f"{r['error_without_host'] * 100:+.1f}% | {sent} | {psent} |")
    held = [r for r in rows if not r["fitted"]]
    within = sum(abs(r["error"]) <= 0.15 for r in held)
    within_before = sum(abs(r["error_without_host"]) <= 0.15 for r in held)
    def rate(value: float) -> str:  # a record without a Muon baseline row fits no cuBLAS rate
        return "—" if value <= 1.0 else f"{value / 1e12:.0f}"

    lines += ["", f"Held out: {within} of {len(held)} within 15% ({within_before} without the host term). Fitted "
              "(TFLOP/s of executed FLOPs on dion3's kernels and of standard NS on cuBLAS; fixed device time per "
              "distributed bucket): " + "; ".join(
                  f"{e}: {rate(v['symmetric'])}, {rate(v['dense'])}, {v['overhead'] * 1e3:.2f} ms (without the host "
                  f"term {rate(before[e]['symmetric'])}, {rate(before[e]['dense'])}, "
                  f"{before[e]['overhead'] * 1e3:.2f} ms)" for e, v in rates.items())]
    return "\n".join(lines)


def launch_table(rows: list[dict], launch_s: float) -> str:
    lines = ["| preset | variant | host ms (median) | launches counted | kernels run (profiler) | µs per launch |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['preset']} | {r['variant']} | {r['host_ms']:.2f} | {r['launches']:.0f} | {r['kernels']} | "
              f"{r['per_launch_us']:.1f} |" for r in rows]
    lines += ["", f"Host time per launch: the median, {launch_s * 1e6:.1f} µs."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
