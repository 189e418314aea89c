"""`dion3 plan`: predicted step time, traffic and memory per rank of Muon, NorMuon and Dion3 on a
layout of W GPUs, from the real planner run on this CPU (see dion3.tools.plan.run and .cost)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Optional

from ..bench.presets import MODELS, named_model
from ..hf_config import ConfigModel
from .fractions import row_share
from .pricing import Hardware, Network
from .run import build_plans, price, setting_variant, stderr_progress, variant
from .step_plan import StepPlan
from .time_to_loss import DATA as EFFICIENCY_DATA
from .time_to_loss import (Run, advised_settings, forward_backward_seconds, load_efficiencies, nearest_regime,
                           other_shapes, predict, recommendation, report, shape_check)
from .world import model_weights, parse_layout

TB, GB, MB = 1e12, 1e9, 1e6
OVERHEAD_MS, LAUNCH_US = 1.5, 43.0
# Sustained rates of dion3's step on one H200 (benchmarks/results/plan-validation-2026-12-02.md):
# orthogonalization on dion3's kernels and standard NS on cuBLAS fitted to the single-device step
# of Llama-8B at 6b0e2bf (Muon + Gram + kernels, Muon baseline); memory passes at the measured
# copy rate; the fixed device time per distributed bucket fitted to the two-H200 FSDP2 record; the
# host time per kernel launch of the eager distributed step measured on an H200's host
# (steps-h200-2026-12-02.md: the step's host time with the device held busy, over its
# launches; the same host assumed for the other GPUs). Other GPUs scale the rates by datasheet
# ratios of dense bf16 peak and HBM bandwidth to the H200's.
# train: the sustained rate of the forward and backward pass, TFLOP/s of 6 · parameters · tokens, measured
# on the largest study model (llama-hf-350m, 8 k tokens a step, compiled, one H200; frontier/steps-h200.json:
# 340-365 by setting, the 19 M and 110 M models 71-83 and 250-268). Larger models run nearer the GPU's
# peak, so at ≥ 1 B this rate overstates the forward and backward and understates the optimizer's share.
GPUS = {
    "h200": dict(symmetric=606.0, dense=566.0, memory=4.3, capacity=141.0, overhead=OVERHEAD_MS, launch=LAUNCH_US,
                 train=350.0),
    "gh200": dict(symmetric=606.0, dense=566.0, memory=4.3, capacity=96.0, overhead=OVERHEAD_MS,
                  launch=LAUNCH_US, train=350.0),  # H100 die, as H200
    "b200": dict(symmetric=606.0 * 2.27, dense=566.0 * 2.27, memory=4.3 * 1.67, capacity=180.0, overhead=OVERHEAD_MS,
                 launch=LAUNCH_US, train=350.0 * 2.27),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dion3 plan", description=__doc__)
    what = p.add_argument_group("model and layout")
    what.add_argument("--preset", help=f"one of {sorted(MODELS)} (default llama-8b)")
    what.add_argument("--shapes", help="custom matrices ROWSxCOLS[:COUNT],... instead of a preset")
    what.add_argument("--hf-config", metavar="PATH",
                      help="a Hugging Face config.json of a Llama-family decoder (Llama, Mistral, Qwen, Mixtral, "
                           "Qwen-MoE) instead of a preset: its matrices, experts and parameters a token")
    what.add_argument("--experts", type=int, help="with --shapes: every shape is a stack [E, rows, cols] of E experts "
                      "(expert parallel: an ep axis splits the experts)")
    what.add_argument("--layout", default="fsdp=8", help="mesh axes, outermost first: fsdp=64,tp=8 · "
                      "replicate=2,fsdp=32 (HSDP) · ep=8,fsdp=8 · a bare W (fsdp=W) · single (default fsdp=8)")
    what.add_argument("--world", type=int, help="check that the layout has this many ranks")
    what.add_argument("--optimizers", default="muon,normuon,dion3",
                      help="some of muon-baseline,muon,normuon,dion3 (default muon,normuon,dion3)")
    what.add_argument("--fraction", type=float, default=0.25, help="Dion3's fraction f (default 0.25)")
    what.add_argument("--scope", default="local", help="Dion3's selection scope: local or global (default local)")
    what.add_argument("--momentum-dtype", default="float32", choices=("float32", "bfloat16"),
                      help="the optimizers' momentum_dtype (default float32, the fp32 parameters')")
    hw = p.add_argument_group("hardware (rates are sustained, not peak)")
    hw.add_argument("--gpu", default="h200", help=f"one of {sorted(GPUS)}: the defaults below (default h200)")
    hw.add_argument("--tflops", type=float, help="orthogonalization on dion3's kernels, TFLOP/s of executed FLOPs")
    hw.add_argument("--tflops-dense", type=float, help="standard NS on cuBLAS (muon-baseline), TFLOP/s")
    hw.add_argument("--memory-tbs", type=float, help="elementwise passes, TB/s")
    hw.add_argument("--capacity-gb", type=float, help="device memory, GB")
    hw.add_argument("--bucket-overhead-ms", type=float,
                    help="fixed device time per distributed bucket per step (small copies, waits), ms")
    hw.add_argument("--launch-us", type=float,
                    help="host time per kernel launch of the eager distributed step, µs (0: no host term)")
    net = p.add_argument_group("network")
    net.add_argument("--node-size", type=int, default=8, help="GPUs per NVLink node (default 8)")
    net.add_argument("--nvlink-gbs", type=float, default=360.0, help="within a node, GB/s per GPU per direction (360)")
    net.add_argument("--fabric-gbs", type=float, default=40.0, help="between nodes, GB/s per GPU per direction (40)")
    net.add_argument("--latency-us", type=float, default=15.0, help="per collective within a node, µs (15)")
    net.add_argument("--fabric-latency-us", type=float, default=40.0, help="per collective across nodes, µs (40)")
    net.add_argument("--no-overlap", action="store_true", help="collectives do not overlap compute")
    run = p.add_argument_group("time to Muon's loss (needs --tokens-per-step)")
    run.add_argument("--tokens-per-step", type=float, metavar="N",
                     help="global tokens a training step: prices Muon, NorMuon and Dion3 1/4, 3/8 and 1/2 by cost (not "
                          "--optimizers, --fraction), and any other setting the data measured on 3 or more seeds, "
                          "models the whole step and recommends the setting that reaches Muon's loss soonest")
    run.add_argument("--train-tokens", type=float, metavar="T",
                     help="tokens of the whole run, for its tokens per parameter (default 20 per hidden matrix parameter)")
    run.add_argument("--train-tflops", type=float,
                     help="the forward and backward pass's sustained rate per GPU, TFLOP/s of 6 · parameters · tokens "
                          "(default: --gpu's, measured on a 350 M model; `python -m dion3.tools.study.train_step` measures "
                          "a model's)")
    run.add_argument("--train-tps", type=float, metavar="TPS",
                     help="instead of --train-tflops: the tokens per second per GPU your training step runs at now, as "
                          "torchtitan logs `tps`, with an optimizer whose step is small (AdamW); the rate is then "
                          "6 · parameters · TPS")
    run.add_argument("--parameters", type=float,
                     help="parameters the forward and backward multiply by (default: the preset's matrices and LM head; "
                          "with --experts, the active parameters per token, required)")
    run.add_argument("--efficiency", default=str(EFFICIENCY_DATA),
                     help="the quality study's step-efficiencies (default: the measured ones shipped with dion3)")
    out = p.add_argument_group("output")
    out.add_argument("--ranks", default="8", help="per-rank rows to print: a number (the slowest first) or 'all'")
    out.add_argument("--verify", type=int, default=0, help="also plan on this many other ranks and check they agree")
    out.add_argument("--json", help="write the full plan as JSON to this path ('-': stdout, no table)")
    out.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def _positive(name: str, value, integer: bool = False):
    if value is not None and (value <= 0 or (integer and int(value) != value)):
        raise ValueError(f"{name} must be {'a positive integer' if integer else 'positive'}, got {value}")
    return value


def settings(args) -> tuple[Hardware, Network]:
    if args.gpu not in GPUS:
        raise ValueError(f"--gpu: unknown GPU {args.gpu!r}; expected one of {sorted(GPUS)}")
    base = GPUS[args.gpu]
    for flag in ("tflops", "tflops_dense", "memory_tbs", "capacity_gb", "nvlink_gbs", "fabric_gbs"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    for flag in ("latency_us", "fabric_latency_us", "bucket_overhead_ms", "launch_us"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be ≥ 0, got {getattr(args, flag)}")
    _positive("--node-size", args.node_size, integer=True)
    if not 0 < args.fraction <= 1:
        raise ValueError(f"--fraction must be in (0, 1], got {args.fraction}")
    if args.scope not in ("local", "global"):
        raise ValueError(f"--scope must be 'local' or 'global', got {args.scope!r}")
    pick = lambda given, default: given if given is not None else default  # noqa: E731
    hw = Hardware(args.gpu, pick(args.tflops, base["symmetric"]) * TB, pick(args.tflops_dense, base["dense"]) * TB,
                  pick(args.memory_tbs, base["memory"]) * TB, pick(args.capacity_gb, base["capacity"]) * GB,
                  bucket_overhead=pick(args.bucket_overhead_ms, base["overhead"]) * 1e-3,
                  launch_s=pick(args.launch_us, base["launch"]) * 1e-6)
    net = Network(args.node_size, args.nvlink_gbs * GB, args.fabric_gbs * GB, args.latency_us * 1e-6,
                  args.fabric_latency_us * 1e-6, not args.no_overlap)
    return hw, net


def model(args) -> ConfigModel:
    """The model's shapes, the experts of each stacked shape, and the parameters a token
    multiplies by (None where only the user can say: --shapes with --experts)."""
    if args.hf_config and args.experts:
        raise ValueError("--hf-config gives the experts itself: leave out --experts")
    if args.experts is not None and (args.experts < 1 or not args.shapes):
        raise ValueError(f"--experts needs --shapes and a count ≥ 1, got {args.experts}")
    described = named_model(args.preset, args.shapes, args.hf_config, "plan")
    if args.experts:
        return ConfigModel(described.preset, {m.name: args.experts for m in described.preset.matrices}, None)
    return described


def row_shares(described: ConfigModel, measured_model: str,
               settings: dict[str, tuple[float, str]]) -> dict[str, tuple[float, Optional[float]]]:
    """Each Dion3 setting's (fraction, allocation) share of the rows on the user's model and on the
    model its efficiency was measured on (None where that model is not one of the presets)."""
    try:
        measured = named_model(measured_model, None, None, "plan")
    except ValueError:
        measured = None
    return {name: (row_share(described.preset.matrices, f, described.experts, allocation),
                   None if measured is None else row_share(measured.preset.matrices, f, measured.experts, allocation))
            for name, (f, allocation) in settings.items()}


def time_to_loss_run(args, described: ConfigModel, layout) -> tuple[Run, dict]:
    """The user's run for the time to Muon's loss, and the measured step-efficiencies."""
    for flag in ("tokens_per_step", "train_tokens", "train_tflops", "train_tps", "parameters"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    if args.train_tflops and args.train_tps:
        raise ValueError("--train-tflops and --train-tps both give the forward and backward's rate: give one")
    if described.active_parameters is None and args.parameters is None:
        raise ValueError("--tokens-per-step with --experts needs --parameters: the parameters one token multiplies by "
                         "(its experts', not every expert's)")
    parameters = args.parameters or described.active_parameters
    hidden = described.hidden_parameters
    tokens = args.train_tokens or 20 * hidden
    # tps tokens a second a GPU, each costing 6 · parameters: the rate in the plan's own terms
    rate = 6.0 * parameters * args.train_tps if args.train_tps else (args.train_tflops or GPUS[args.gpu]["train"]) * TB
    run = Run(args.tokens_per_step, layout.world_size, parameters, hidden, tokens / hidden, args.train_tokens is None, rate)
    return run, load_efficiencies(args.efficiency)


def summary(step: StepPlan, overlap: bool) -> dict:
    r = step.ranks.values()
    return dict(
        optimizer=step.variant.label, step_ms=step.critical_path_s(overlap) * 1e3, fixed_ms=step.overhead_s * 1e3,
        host_ms=step.host_s * 1e3, host_exposed_ms=step.exposed_s * 1e3,
        compute_ms_max=step.worst(lambda c: c.compute_s) * 1e3,
        memory_pass_ms_max=step.worst(lambda c: c.memory_s) * 1e3,
        communication_ms=step.communication_s * 1e3,
        collectives_ms={k: v * 1e3 for k, v in step.collectives.items()},
        imbalance=step.imbalance(), matrices=sum(c.owned for c in r),
        tflop_executed=sum(c.executed_flops for c in r) / TB,
        sent_mb_max=step.worst(lambda c: c.total_sent) / MB, memory_gb_max=step.worst(step.memory_per_rank) / GB,
    )


def rank_rows(step: StepPlan) -> list[dict]:
    rows = []
    for rank, c in sorted(step.ranks.items()):
        rows.append(dict(rank=rank, owned=c.owned, tflop=c.executed_flops / TB, compute_ms=c.compute_s * 1e3,
                         memory_pass_ms=c.memory_s * 1e3, sent_mb={k: v / MB for k, v in c.sent.items()},
                         received_mb={k: v / MB for k, v in c.received.items()},
                         memory_gb=dict(params=c.params / GB, grads=c.grads / GB, state=c.state / GB,
                                        transient=c.transient / GB, adamw=step.scalar_bytes / GB,
                                        total=step.memory_per_rank(c) / GB)))
    return rows


def table(steps: dict[str, StepPlan], overlap: bool, ranks: str) -> str:
    lines = ["| optimizer | step ms | compute ms (max) | memory passes ms (max) | comm ms | host ms (device waits) | "
             "imbalance | MB sent/rank (max) | GB/rank (max) |", "|---|---|---|---|---|---|---|---|---|"]
    for step in steps.values():
        s = summary(step, overlap)
        lines.append(f"| {s['optimizer']} | {s['step_ms']:.1f} | {s['compute_ms_max']:.1f} | "
                     f"{s['memory_pass_ms_max']:.1f} | {s['communication_ms']:.2f} | "
                     f"{s['host_ms']:.1f} ({s['host_exposed_ms']:.1f}) | {s['imbalance']:.3f} | "
                     f"{s['sent_mb_max']:.1f} | {s['memory_gb_max']:.1f} |")
    for step in steps.values() if ranks != "0" else ():
        rows = sorted(rank_rows(step), key=lambda r: (-r["compute_ms"], r["rank"]))
        shown = rows if ranks == "all" else rows[: int(ranks)]
        lines += ["", f"{step.variant.label}: {len(shown)} of {len(rows)} ranks, slowest owner first",
                  "| rank | matrices | TFLOP | compute ms | memory passes ms | MB sent (by kind) | "
                  "GB params/grads/state/transient/AdamW |",
                  "|---|---|---|---|---|---|---|"]
        for r in shown:
            sent = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["sent_mb"].items())) or "0"
            m = r["memory_gb"]
            lines.append(f"| {r['rank']} | {r['owned']} | {r['tflop']:.2f} | {r['compute_ms']:.1f} | "
                         f"{r['memory_pass_ms']:.1f} | {sent} | {m['params']:.1f}/{m['grads']:.1f}/{m['state']:.1f}/"
                         f"{m['transient']:.1f}/{m['adamw']:.1f} |")
    return "\n".join(lines)


def fits(step: StepPlan, hw: Hardware) -> bool:
    """Whether the step's busiest rank holds its parameters, gradients, state and buffers."""
    return step.worst(step.memory_per_rank) <= hw.capacity


def memory_warning(steps: dict[str, StepPlan], hw: Hardware) -> Optional[str]:
    """One line naming the optimizers whose busiest rank needs more memory than the device holds
    (such a run stops on out-of-memory, whatever its timings say); None when all fit."""
    over = [step for step in steps.values() if not fits(step, hw)]
    if not over:
        return None
    named = ", ".join(f"{step.variant.label} {step.worst(step.memory_per_rank) / GB:.1f} GB" for step in over)
    return (f"does not fit a GPU of {hw.capacity / GB:.0f} GB ({hw.name}; --capacity-gb sets it): {named} on the busiest "
            f"rank (parameters, gradients, optimizer state and the step's transient buffers; activations come on "
            f"top). Shard over more ranks (--layout fsdp=N) or split the largest same-shape groups into several "
            f"parameter groups (docs/memory.md).")


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.ranks != "all" and not (args.ranks.isdigit() and int(args.ranks) >= 0):
            raise ValueError(f"--ranks must be a number ≥ 0 or 'all', got {args.ranks!r}")
        if args.verify < 0:
            raise ValueError(f"--verify must be ≥ 0, got {args.verify}")
        hw, net = settings(args)
        layout = parse_layout(args.layout, args.world)
        described = model(args)
        preset = described.preset
        if described.note:
            print(f"dion3 plan: note: {described.note}", file=sys.stderr)
        momentum = None if args.momentum_dtype == "float32" else args.momentum_dtype
        if args.tokens_per_step is not None:
            run, efficiencies = time_to_loss_run(args, described, layout)
            regime = nearest_regime(efficiencies, run.tokens_per_step, run.tokens_per_parameter)
            names = advised_settings(efficiencies[regime])
            variants = [setting_variant(n, args.scope, momentum) for n in names]
        else:
            names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
            variants = [variant(n, args.fraction, args.scope, momentum) for n in names]
    except ValueError as error:
        print(f"dion3 plan: {error}", file=sys.stderr)
        return 2
    progress = None if args.quiet else stderr_progress
    planned = build_plans(model_weights(preset.matrices, described.experts), layout, variants, verify=args.verify,
                          progress=progress)
    steps = price(planned, variants, hw, net, preset.scalar_numel)
    overlap = not args.no_overlap
    head = (f"{preset.name} ({preset.description}; {described.hidden_parameters / 1e9:.2f} B matrix parameters) on "
            f"{layout.describe()} = {layout.world_size} ranks, {hw.name}: {hw.symmetric_flops / TB:.0f}/"
            f"{hw.dense_flops / TB:.0f} TFLOP/s (kernels/cuBLAS NS), {hw.memory_bytes / TB:.2f} TB/s, "
            f"{hw.bucket_overhead * 1e3:.1f} ms per distributed bucket, {hw.launch_s * 1e6:.0f} µs host time "
            f"per launch; nodes of "
            f"{net.node_size}, {net.nvlink / GB:.0f} GB/s within, {net.fabric / GB:.0f} GB/s across, "
            f"{net.latency * 1e6:.0f}/{net.fabric_latency * 1e6:.0f} µs per collective; planned in "
            f"{planned.seconds:.1f} s on rank 0" + (f" and ranks {list(planned.verified_ranks)} (same owners)"
                                                    if planned.verified_ranks else ""))
    advice = None
    if args.tokens_per_step is not None:
        optimizer_s = {name: steps[v.label].critical_path_s(overlap) for name, v in zip(names, variants)}
        forward_backward = forward_backward_seconds(run.parameters, run.tokens_per_step, run.world_size,
                                                    run.flops_per_second)
        predictions = predict(optimizer_s, forward_backward, efficiencies[regime])
        checks = [(g, efficiencies[g]) for g in other_shapes(efficiencies, regime)]
        labels = {name: v.label for name, v in zip(names, variants)}
        shares = row_shares(described, regime.model, {name: (v.fraction, v.allocation) for name, v in zip(names, variants)
                                                      if v.algorithm == "dion3"})
        advice = dict(text=report(run, regime, forward_backward, predictions, labels, checks, shares),
                      run=asdict(run), regime=asdict(regime), forward_backward_s=forward_backward,
                      predictions=[asdict(p) for p in predictions], recommendation=recommendation(predictions),
                      other_shapes=[dict(regime=asdict(g), time_ratios=shape_check(predictions, e)) for g, e in checks],
                      row_shares={name: dict(this_model=here, measured_model=there) for name, (here, there) in shares.items()})
    if args.json:
        data = dict(header=head, model=preset.name, layout=layout.describe(), world_size=layout.world_size,
                    hardware=asdict(hw), network=asdict(net), planning_seconds=planned.seconds,
                    verified_ranks=list(planned.verified_ranks),
                    optimizers=[dict(summary(s, overlap), fits=fits(s, hw),
                                     ranks=rank_rows(s)) for s in steps.values()])
        if advice is not None:
            data["time_to_loss"] = {k: v for k, v in advice.items() if k != "text"}
        text = json.dumps(data, indent=1)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    print(head + "\n")
    print(table(steps, overlap, args.ranks))
    warning = memory_warning(steps, hw)
    if warning:
        print("\n" + warning)
    if advice is not None:
        print("\n" + advice["text"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
