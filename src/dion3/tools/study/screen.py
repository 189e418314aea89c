"""The screening of Dion3 rule variants (the frontier issue's rule): each Dion3 run that differs
from the rule in what the study varies (fractions on every matrix instead of by cost, μ, rows by
L2, rows weighted, Newton–Schulz steps, the unselected rows' decay, periodic full steps) is put
beside the rule's run of the same model, batch, horizon, fraction, lr and seed; the table gives
the difference, the variant's step-efficiency read on Muon's curve of that model and batch, and
the verdict: ahead of the rule by more than --margin (default 0.002, about two seed sds at batch
128) → seeds 1 and 2 next; else not kept. The variant furthest ahead (if any is ahead at all) is
the screen's best whatever the margin: the frontier issue gives the best three seeds and the
held-out shape, so its verdict says so. Once a variant's other seeds have landed (≥ 3 seeds paired
with the rule's runs of the same seeds), or its runs on another model at this batch and horizon,
its row gives the paired differences' mean ± sd over the seeds, and the verdict follows them:
kept only if ahead over the seeds by more than one sd and not behind on any other model.

    python -m dion3.tools.study.screen --results benchmarks/results/frontier --model llama-384 \\
        --batch-size 128 [--horizon 1500] [--seed 0] [--rule-mu 0.6]
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Optional, Sequence

from ...optim.cost_fractions import COST_RULE
from .efficiency import muon_curve, steps_to_loss
from .points import best_points
from .launch import read_results
from .runs import DEFAULT_NS, Run

# what the rule is in each field the screening varies (μ is the rule's tuned one, --rule-mu)
RULE = dict(fraction_allocation="cost", cost_rule=COST_RULE, row_score="l1", fraction_weights=None,
            ns_coefficients=DEFAULT_NS, unselected_decay=1.0, full_every=0, momentum_dtype=None, fraction_warmup=0)


def rule_config(config: dict, rule_mu: float) -> dict:
    """The config of the rule's run a variant is compared with: the variant's with every screened
    field set to the rule's."""
    return {**config, **RULE, "mu": rule_mu}


def paired(by_key: dict, config: dict, rule_mu: float, seeds: Sequence[int]) -> Optional[tuple[float, float, int]]:
    """(mean, sd, n) of the variant's loss minus the rule's over the seeds both ran with `config`
    (its seed and model replaced per run); None below two seeds."""
    differences = []
    for seed in seeds:
        variant = by_key.get(Run(**{**config, "seed": seed}).key)
        rule = by_key.get(Run(**rule_config({**config, "seed": seed}, rule_mu)).key)
        if variant is not None and rule is not None:
            differences.append(variant["final_val_loss"] - rule["final_val_loss"])
    if len(differences) < 2:
        return None
    return statistics.fmean(differences), statistics.stdev(differences), len(differences)


def _side(summary: tuple[float, float, int]) -> str:
    """ahead, behind or level: the mean difference beyond one sd of it, or not."""
    mean, sd, _ = summary
    return "ahead" if mean + sd < 0 else "behind" if mean - sd > 0 else "level"


def seeded_verdict(over_seeds: tuple[float, float, int], held_out: dict[str, tuple[float, float, int]]) -> str:
    """The verdict once the seeds have landed: kept only if ahead over them and behind on no other model."""
    parts = ", ".join([f"over {over_seeds[2]} seeds {_side(over_seeds)}"]
                      + [f"{other} {_side(summary)}" for other, summary in sorted(held_out.items())])
    if _side(over_seeds) != "ahead" or any(_side(summary) == "behind" for summary in held_out.values()):
        return "not kept: " + parts
    return ("kept: " if held_out else "ahead over the seeds, the held-out shape next: ") + parts


def screen(records: Sequence[dict], model: str, batch: int, horizon: int, seed: int, rule_mu: float = 0.6,
           margin: float = 0.002, compiled: bool = True) -> list[dict]:
    """A row per variant run of the regime and seed (the rule's own runs left out)."""
    by_key = {r["key"]: r for r in records}
    seeds = sorted({r["seed"] for r in records})
    others = sorted({r["config"]["model"] for r in records} - {model})
    horizons = {r["config"]["horizon"] for r in records
                if r["config"]["model"] == model and r["config"].get("batch_size") == batch}
    curve = muon_curve({h: best_points(records, model, h, compiled, batch) for h in horizons})
    rows = []
    for record in records:
        config = record["config"]
        if (config["optimizer"] != "dion3" or config["model"] != model or config.get("batch_size") != batch
                or config["horizon"] != horizon or record["seed"] != seed or config.get("compiled", False) != compiled):
            continue
        rule = Run(**rule_config(config, rule_mu))
        if rule.key == record["key"]:
            continue  # the rule itself
        reference = by_key.get(rule.key)
        loss = record["final_val_loss"]
        row = dict(variant=Run(**config).label, loss=loss, reference=rule.label,
                   reference_loss=None, difference=None, efficiency=None, verdict="",
                   seeds=paired(by_key, config, rule_mu, seeds),
                   held_out={other: summary for other in others
                             if (summary := paired(by_key, {**config, "model": other}, rule_mu, seeds)) is not None})
        if len(curve) >= 2:
            steps, outside = steps_to_loss(curve, loss)
            row["efficiency"] = (round(steps / horizon, 3), outside)
        if reference is None:
            row["verdict"] = "no run of the rule to compare with"
        else:
            difference = loss - reference["final_val_loss"]
            row.update(reference_loss=reference["final_val_loss"], difference=difference)
            row["verdict"] = (f"ahead by more than {margin:g}: seeds 1 and 2 next" if difference < -margin
                              else f"not kept: behind by more than {margin:g}" if difference > margin
                              else f"not kept: within {margin:g} of the rule")
        rows.append(row)
    rows.sort(key=lambda r: (r["difference"] is None, r["difference"] or 0.0))
    if rows and rows[0]["difference"] is not None and rows[0]["difference"] < 0:
        ahead = rows[0]["difference"] < -margin
        rows[0]["verdict"] = ("the best, " + ("ahead by more than" if ahead else "within") + f" {margin:g}: "
                              "seeds 1 and 2, then the held-out shape")
    for row in rows:  # the seeds and other models landed since overrule seed 0
        if row["seeds"] is not None and row["seeds"][2] >= 3:
            row["verdict"] = seeded_verdict(row["seeds"], row["held_out"])
    return rows


def table(rows: Sequence[dict]) -> str:
    def summary(s: Optional[tuple[float, float, int]]) -> str:
        return "—" if s is None else f"{s[0]:+.4f} ± {s[1]:.4f} ({s[2]})"

    lines = ["| variant | final val loss | the rule's run | its loss | difference | e on Muon's curve | "
             "difference over the seeds (n) | other models | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = "—" if r["efficiency"] is None else f"{r['efficiency'][0]:.3f}" + (" (extended)" if r["efficiency"][1] else "")
        reference_loss = "—" if r["reference_loss"] is None else f"{r['reference_loss']:.4f}"
        difference = "—" if r["difference"] is None else f"{r['difference']:+.4f}"
        held_out = "; ".join(f"{m} {summary(v)}" for m, v in sorted(r["held_out"].items())) or "—"
        lines.append(f"| {r['variant']} | {r['loss']:.4f} | {r['reference']} | {reference_loss} | {difference} | {e} | "
                     f"{summary(r['seeds'])} | {held_out} | {r['verdict']} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dion3.tools.study.screen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, nargs="+", required=True, help="study folders or results.jsonl files")
    parser.add_argument("--model", required=True, help="the study model screened (e.g. llama-384)")
    parser.add_argument("--batch-size", type=int, required=True, help="the batch of the screened runs (e.g. 128)")
    parser.add_argument("--horizon", type=int, default=1500, help="the runs' steps (default 1500)")
    parser.add_argument("--seed", type=int, default=0, help="the seed screened (default 0)")
    parser.add_argument("--rule-mu", type=float, default=0.6, help="the rule's μ (default 0.6, the tuned one)")
    parser.add_argument("--margin", type=float, default=0.002, help="how far ahead a variant must be (default 0.002)")
    parser.add_argument("--eager", action="store_true", help="eager runs (default: runs with --compile)")
    args = parser.parse_args(argv)
    if args.margin < 0:
        parser.error(f"--margin must be ≥ 0, got {args.margin}")
    records = [r for path in args.results for r in read_results(path / "results.jsonl" if path.is_dir() else path)]
    if not records:
        parser.error(f"--results: no finished runs in {[str(p) for p in args.results]}")
    rows = screen(records, args.model, args.batch_size, args.horizon, args.seed, args.rule_mu, args.margin,
                  not args.eager)
    print(f"# Rule variants: {args.model}, batch {args.batch_size}, {args.horizon} steps, seed {args.seed}\n")
    print(table(rows) if rows else "No Dion3 run there differs from the rule.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
