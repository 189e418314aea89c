"""torchtitan's DistMuon beside dion3 on one torchtitan model and layout, and a torchtitan run of
Dion3 with a DCP save → resume.

    python3 benchmarks/distmuon_compare.py --part compare --out DIR   # DistMuon vs dion3
    python3 benchmarks/distmuon_compare.py --part train --out DIR     # Dion3 loss curve + resume

With CUDA: one process, a world of 1 over NCCL, FSDP2 at one rank (torchtitan's parallelize_llama
with dp_shard=1: every parameter a DTensor on a one-rank mesh). Without CUDA: --world gloo ranks
on CPU (FSDP2 over them), the correctness layout; there torchtitan's meshes are built on "cpu"
and FSDP2 reduces with a plain sum (torchtitan's divide factor of 1 is a PREMUL_SUM, which gloo
lacks). Attention runs on torchtitan's SDPA module (no FlexAttention compile).

compare: torchtitan's Llama 3 (`--flavor`, default 1B on CUDA, debugmodel on CPU) in four copies
with the same weights. Each step one copy computes gradients and the others receive them, so every
optimizer sees the same gradient history; each copy's matrices are stepped by one optimizer (the
embeddings, head and norms are left alone):
  distmuon        torchtitan's DistMuon (torchtitan's container, `Owned` compute layout, one bucket
                  per layer): momentum 0.95, Nesterov, Jordan's quintic × 5 in bf16. DistMuon
                  refuses to run without CUDA: on CPU its rule runs from its own functions on
                  whole matrices (DistMuonRule) — the CPU run checks the comparison, not its runtime;
  muon_matched    dion3 Muon with the same rule: mu 0.95, Nesterov, Jordan's quintic × 5 (standard
                  Newton–Schulz; dion3's precision);
  muon            dion3 Muon as shipped (Polar Express, method "auto": Gram NS where it pays);
  dion3           dion3 Dion3, fraction 1/4, global selection.
Recorded per optimizer: step time (CUDA events, median over --steps after --warmup), peak memory
of the step above what was allocated before it, the memory it keeps (after building it and one
step on zero gradients, as torchtitan's init_optim_state does, over before), its state tensors,
and per matrix the cosine between its update and DistMuon's on the same gradients (DistMuon's
momentum is an EMA, dion3's a sum: the same direction).

train: torchtitan's Llama-3 debug model with the optimizer of docs/integrations.md
(Dion3 f = 1/4, global selection, fraction warmup; torchtitan's warmup-stable-decay LR schedule)
on bigram-chain token data for --train-steps steps, checkpointed with torchtitan's
CheckpointManager at half way; then a freshly built and differently initialized model loads that
checkpoint and trains the second half again. Recorded: both loss curves and their largest gap.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SEQ_LEN = 256
LR = 0.02


# ----------------------------------------------------------------------------- torchtitan pieces
SHIMS: list[str] = []


def torch_compat() -> None:
    """torchtitan 0.3 imports `DataParallelMeshDims` from torch.distributed.fsdp, which torch 2.11
    lacks (2.13 has it). It only types the FSDP mesh axes of torchtitan's full_dtensor/spmd_types
    backends; the partial_dtensor path used here never builds one. On an older torch a
    placeholder lets torchtitan import, and the report says so (environment.shims)."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        @dataclasses.dataclass(frozen=True)
        class DataParallelMeshDims:  # never instantiated on this script's path
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        SHIMS.append(f"torch.distributed.fsdp.DataParallelMeshDims placeholder (torch {torch.__version__})")


def use_cpu() -> None:
    """torchtitan resolves its device type at import ("cuda" when no accelerator is found)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tools

    tools.device_type = "cpu"
    parallel_dims.device_type = "cpu"


def model_spec(flavor: str):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry(flavor)
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ_LEN)
    return spec


_DIMS = {}


def parallel_dims(dp: int):
    """torchtitan's ParallelDims for FSDP2 over dp ranks (built once per process)."""
    if dp not in _DIMS:
        from torchtitan.config import ParallelismConfig
        from torchtitan.distributed import ParallelDims

        parallelism = ParallelismConfig(data_parallel_shard_degree=dp, spmd_backend="partial_dtensor")
        dims = ParallelDims.from_config(parallelism, dist.get_world_size())
        dims.build_mesh()
        _DIMS[dp] = (dims, parallelism)
    return _DIMS[dp]


def build_model(flavor: str, device: torch.device, seed: int):
    """torchtitan's model on meta → parallelize_llama (FSDP2 over the world) → init_weights."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama

    dims, parallelism = parallel_dims(dist.get_world_size())
    spec = model_spec(flavor)
    training = TrainingConfig(local_batch_size=1, seq_len=SEQ_LEN, mixed_precision_param="float32")
    with torch.device("meta"):
        model = spec.model.build()
    model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=tempfile.gettempdir())
    if device.type == "cpu":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return spec, model


def bigram_batch(step: int, batch: int, vocab_used: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences of a fixed random bigram chain over the first vocab_used ids (the same
    chain every step, fresh sequences per step): a law the model can learn."""
    chain = torch.softmax(2.0 * torch.randn(vocab_used, vocab_used, generator=torch.Generator().manual_seed(7)), -1)
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(batch, SEQ_LEN + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab_used, (batch,), generator=gen)
    for t in range(SEQ_LEN):
        tokens[:, t + 1] = torch.multinomial(chain[tokens[:, t]], 1, generator=gen).squeeze(1)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]


def local_loss(model, inputs, labels, total_tokens: int) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    logits = model(inputs)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / total_tokens


def my_rows(batch: int) -> slice:
    world, rank = dist.get_world_size(), dist.get_rank()
    return slice(rank * batch // world, (rank + 1) * batch // world)


# ----------------------------------------------------------------------------- compare
NON_MATRIX = r"(norm\.weight|\.bias)$|(^|\.)(tok_embeddings|output|lm_head)\.|\.router\.gate\."


def matrix_names(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dim() >= 2 and not re.search(NON_MATRIX, n)]


def exact(names: list[str]) -> str:
    return "^(" + "|".join(re.escape(n) for n in names) + ")$"


def distmuon_container(model, names: list[str]):
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned

    params = dict(model.named_parameters())
    axis = params[names[0]].device_mesh.mesh_dim_names[0]
    layout = ComputeLayout(shardings_by_mesh_axis={axis: Owned()})
    layers = sorted({n.split(".")[1] for n in names}, key=int)
    config = OptimizersContainer.Config(
        implementation="foreach",
        param_groups=[ParamGroupConfig(pattern=exact(names), optimizer_name="DistMuon", optimizer_kwargs={
            "lr": LR, "weight_decay": 0.0, "momentum": 0.95, "nesterov": True, "foreach": False})],
        optimizer_factory_kwargs_by_name={"DistMuon": {
            "compute_sharding_by_fqn": {n: layout for n in names},
            "bucket_configs": tuple(BucketConfig(name=f"layer {i}", patterns=(f"layers.{i}.*",)) for i in layers),
        }},
    )
    return _only_matrices(config, model, names)


class DistMuonRule(torch.optim.Optimizer):
    """DistMuon's update on CPU, where DistMuon itself refuses to run (it needs one CUDA device
    per process): torchtitan's own functions of DistMuon (momentum, bf16 Newton–Schulz, update)
    applied to each whole matrix, gathered from and written back to the FSDP2 shards — the rule
    without its FlexShard runtime."""

    def __init__(self, params, lr: float = LR, momentum: float = 0.95, nesterov: bool = True, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import distribute_tensor
        from torchtitan.distributed.flex_shard import dist_muon as rule

        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad.full_tensor()
                buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(grad))
                prepared = rule._prepare_muon_input(grad, buffer, momentum=group["momentum"], nesterov=group["nesterov"],
                                                    out=torch.empty_like(grad))
                direction = rule._zeropower_via_newtonschulz(prepared, ns_coefficients=(3.4445, -4.7750, 2.0315),
                                                             ns_steps=5, eps=1e-7)
                whole = p.full_tensor()
                rule._apply_muon_update(whole, direction.to(whole.dtype), lr=group["lr"], weight_decay=group["weight_decay"],
                                        adjust_lr_fn=None, compute_matrix_shape=whole.shape)
                p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements).to_local())


def distmuon_rule(model, names: list[str]) -> DistMuonRule:
    keep = set(names)
    for n, p in model.named_parameters():
        p.requires_grad_(n in keep)
    params = dict(model.named_parameters())
    return DistMuonRule([params[n] for n in names])


def dion3_container(model, names: list[str], name: str, **settings):
    from torchtitan.components.optimizer import ParamGroupConfig

    from dion3.integrations.torchtitan import Dion3OptimizersContainer

    config = Dion3OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=exact(names), optimizer_name=name, optimizer_kwargs={"lr": LR, "weight_decay": 0.0, **settings})])
    return _only_matrices(config, model, names)


def _only_matrices(config, model, names):
    """The container over the matrices only: the other parameters are frozen for the comparison
    (torchtitan's container insists that every trainable parameter has an optimizer)."""
    keep = set(names)
    for n, p in model.named_parameters():
        p.requires_grad_(n in keep)
    return config.build(model_parts=[model])


VARIANTS = {
    "distmuon": None,
    "muon_matched": ("Muon", dict(mu=0.95, nesterov=True, ns_coefficients="jordan", orthogonalizer="newton_schulz")),
    "muon": ("Muon", dict(mu=0.95, nesterov=True)),
    "dion3": ("Dion3", dict(fraction=0.25, selection_scope="global")),
}


def state_bytes(optimizer) -> int:
    from torch.distributed.tensor import DTensor

    total, seen = 0, set()
    for entry in optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
                if key not in seen:
                    seen.add(key)
                    total += local.numel() * local.element_size()
    return total


def materialize(optimizer, model, names: list[str]) -> None:
    """One step on zero gradients (torchtitan's init_optim_state does the same): whatever an
    optimizer allocates on its first step exists afterwards, and nothing moves (weight decay 0)."""
    params = dict(model.named_parameters())
    for n in names:
        params[n].grad = torch.zeros_like(params[n])
    optimizer.step()
    for n in names:
        params[n].grad = None


def compare(args, device) -> dict:
    cuda = device.type == "cuda"
    results = {"flavor": args.flavor, "world": dist.get_world_size(), "variants": {},
               "distmuon": "torchtitan's DistMuon" if cuda else "DistMuon's rule from its own functions on whole "
               "matrices (DistMuon itself needs one CUDA device per process; this stand-in keeps each "
               "matrix's whole momentum on every rank)"}
    models, optimizers, kept = {}, {}, {}
    for i, variant in enumerate(VARIANTS):
        spec, model = build_model(args.flavor, device, seed=0)
        if i:
            with torch.no_grad():  # the same weights, local shard by local shard (same layout)
                for p, q in zip(models["distmuon"].parameters(), model.parameters()):
                    q.to_local().copy_(p.to_local())
        names = matrix_names(model)
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        if variant == "distmuon" and cuda:
            try:
                optimizers[variant] = distmuon_container(model, names).optimizers[0]
                materialize(optimizers[variant], model, names)
            except Exception:  # noqa: BLE001 - recorded; the dion3 rows are still measured against its rule
                import traceback

                results["distmuon_error"] = traceback.format_exc()
                results["distmuon"] = "DistMuon failed (distmuon_error); its rule from its own functions stands in"
                print(results["distmuon_error"], file=sys.stderr, flush=True)
                optimizers[variant] = distmuon_rule(model, names)
                materialize(optimizers[variant], model, names)
        elif variant == "distmuon":
            optimizers[variant] = distmuon_rule(model, names)
            materialize(optimizers[variant], model, names)
        else:
            optimizers[variant] = dion3_container(model, names, VARIANTS[variant][0], **VARIANTS[variant][1]).optimizers[0]
            materialize(optimizers[variant], model, names)
        models[variant] = model
        if cuda:
            torch.cuda.synchronize()
            kept[variant] = torch.cuda.memory_allocated() - before
    names = matrix_names(models["distmuon"])
    shapes = {n: list(p.shape) for n, p in models["distmuon"].named_parameters() if n in names}
    results["matrices"] = len(names)
    results["matrix_params"] = sum(torch.Size(s).numel() for s in shapes.values())
    vocab_used = min(256, spec.model.vocab_size)
    times = {v: [] for v in VARIANTS}
    peaks = {v: [] for v in VARIANTS}
    cosines = {v: [] for v in VARIANTS if v != "distmuon"}
    source = models["distmuon"]
    for step in range(args.warmup + args.steps):
        inputs, labels = bigram_batch(step, args.batch, vocab_used, device)
        rows = my_rows(args.batch)
        source.zero_grad(set_to_none=True)
        local_loss(source, inputs[rows], labels[rows], args.batch * SEQ_LEN).backward()
        grads = {n: p.grad for n, p in source.named_parameters() if n in names}
        reference = None  # DistMuon's update of each matrix (local shard), stepped first
        for variant, model in models.items():
            params = dict(model.named_parameters())
            if model is not source:
                for n in names:
                    params[n].grad = grads[n].detach().clone()
            old = {n: params[n].to_local().detach().clone() for n in names}
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                dist.barrier()
                began = time.perf_counter()
            optimizers[variant].step()
            if cuda:
                stop.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(stop)
                peaks[variant].append(torch.cuda.max_memory_allocated() - base)
            else:
                elapsed = 1e3 * (time.perf_counter() - began)
            if step >= args.warmup:
                times[variant].append(elapsed)
            update = {n: params[n].to_local().detach() - old[n] for n in names}
            del old
            if model is not source:
                for n in names:
                    params[n].grad = None
            if reference is None:
                reference = update
                continue
            dots = torch.stack([torch.stack([(update[n].double() * reference[n].double()).sum(),
                                             update[n].double().square().sum(),
                                             reference[n].double().square().sum()]) for n in names])
            dist.all_reduce(dots)  # FSDP shards are disjoint pieces of each matrix
            cosines[variant].append((dots[:, 0] / (dots[:, 1].sqrt() * dots[:, 2].sqrt()).clamp_min(1e-30)).tolist())
            del update
        del reference, grads
    for variant in VARIANTS:
        entry = {"step_ms_median": statistics.median(times[variant]), "step_ms_all": times[variant],
                 "state_bytes": state_bytes(optimizers[variant])}
        if cuda:
            entry["step_peak_bytes_median"] = statistics.median(peaks[variant])
            entry["kept_bytes"] = kept[variant]
        if variant in cosines:
            flat = [c for per_step in cosines[variant] for c in per_step]
            entry["cosine_to_distmuon"] = {"min": min(flat), "median": statistics.median(flat),
                                           "first_step_min": min(cosines[variant][0]),
                                           "last_step_min": min(cosines[variant][-1])}
        results["variants"][variant] = entry
    results["shapes"] = sorted({tuple(s) for s in shapes.values()})
    return results


# ----------------------------------------------------------------------------- train
def docs_optimizer(model_config):
    """The optimizer of docs/integrations.md (its block's dion3_optimizer call)."""
    from dion3 import FractionWarmup
    from dion3.integrations.torchtitan import dion3_optimizer

    return dion3_optimizer(model_config, algorithm="Dion3", lr=0.02, adamw_lr=3e-3, weight_decay=0.1,
                           fraction=0.25, selection_scope="global",
                           fraction_schedule=FractionWarmup(target=0.25, steps=4))


def train_run(args, device, folder: str, seed: int, first: int, save_at=None, load_step=None) -> dict:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    spec, model = build_model("debugmodel", device, seed)
    optimizers = docs_optimizer(spec.model).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=max(1, args.train_steps // 10), decay_ratio=0.8).build(
        optimizers=optimizers, training_steps=args.train_steps)
    checkpointer = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=save_at or args.train_steps + 1, keep_latest_k=0,
        last_save_model_only=False, load_only=save_at is None,
    ).build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
            states={}, sd_adapter=None, base_folder=folder)
    if load_step is not None:
        checkpointer.load(step=load_step)
    record = {"steps": [], "losses": [], "fractions": [], "step_s": []}
    for step in range(first, args.train_steps + 1):
        inputs, labels = bigram_batch(step, args.batch, 256, device)
        rows = my_rows(args.batch)
        began = time.perf_counter()
        optimizers.zero_grad()
        loss = local_loss(model, inputs[rows], labels[rows], args.batch * SEQ_LEN)
        loss.backward()
        fraction = next(g["fraction"] for o in optimizers for g in o.param_groups if g.get("algorithm") == "dion3")
        optimizers.step()
        schedulers.step()
        checkpointer.save(curr_step=step)
        total = loss.detach().clone()
        dist.all_reduce(total)
        record["steps"].append(step)
        record["losses"].append(total.item())
        record["fractions"].append(fraction)
        record["step_s"].append(time.perf_counter() - began)
    checkpointer.close()
    return record


def train(args, device) -> dict:
    folder = tempfile.mkdtemp(prefix="dion3-torchtitan-")
    if dist.get_world_size() > 1:  # one folder for all ranks
        holder = [folder]
        dist.broadcast_object_list(holder, src=0)
        folder = holder[0]
    half = args.train_steps // 2
    whole = train_run(args, device, folder, seed=0, first=1, save_at=half)
    resumed = train_run(args, device, folder, seed=1, first=half + 1, load_step=half)
    gap = max(abs(a - b) for a, b in zip(whole["losses"][half:], resumed["losses"]))
    return {"model": "llama3 debugmodel (SDPA attention)", "world": dist.get_world_size(), "batch": args.batch,
            "seq_len": SEQ_LEN, "save_at": half, "uninterrupted": whole, "resumed": resumed,
            "largest_loss_gap_after_resume": gap}


# ----------------------------------------------------------------------------- reporting, launch
def environment() -> dict:
    import torchtitan

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    info = {"torch": torch.__version__, "torchtitan": torchtitan.__version__, "python": platform.python_version(),
            "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "shims": list(SHIMS)}
    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return info


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# DistMuon beside dion3 ({env['device']}, world {report.get('compare', report.get('train', {})).get('world')})",
             "", f"torch {env['torch']}, torchtitan {env['torchtitan']}, commit {env['commit'][:12]}, {env['date']}",
             f"command: `{env['command']}`", *([f"shims: {'; '.join(env['shims'])}"] if env.get("shims") else []), ""]
    if "compare" in report:
        c = report["compare"]
        lines += [f"## Optimizer step, torchtitan Llama 3 {c['flavor']} ({c['matrices']} matrices, "
                  f"{c['matrix_params'] / 1e6:.1f} M parameters), FSDP2",
                  "", f"distmuon: {c['distmuon']}",
                  *([f"DistMuon's error: `{c['distmuon_error'].strip().splitlines()[-1]}`"] if "distmuon_error" in c else []),
                  "", "| optimizer | step ms (median) | step peak MiB | kept MiB | state MiB | cosine to DistMuon (min / median) |",
                  "|---|---|---|---|---|---|"]
        for name, v in c["variants"].items():
            cos = v.get("cosine_to_distmuon")
            cos_text = f"{cos['min']:.4f} / {cos['median']:.4f}" if cos else "—"
            peak = f"{v['step_peak_bytes_median'] / 2**20:.0f}" if "step_peak_bytes_median" in v else "—"
            kept = f"{v['kept_bytes'] / 2**20:.0f}" if "kept_bytes" in v else "—"
            lines.append(f"| {name} | {v['step_ms_median']:.2f} | {peak} | {kept} | {v['state_bytes'] / 2**20:.0f} | {cos_text} |")
        lines.append("")
    if "train" in report:
        t = report["train"]
        u, r = t["uninterrupted"], t["resumed"]
        lines += [f"## Dion3 through torchtitan's pieces: {t['model']}, batch {t['batch']} × {t['seq_len']}",
                  "", f"checkpoint at step {t['save_at']}; largest loss gap after resume: {t['largest_loss_gap_after_resume']:.3g}",
                  "", "| step | loss | loss after resume | fraction |", "|---|---|---|---|"]
        resumed = dict(zip(r["steps"], r["losses"]))
        for step, loss, fraction in zip(u["steps"], u["losses"], u["fractions"]):
            after = f"{resumed[step]:.5f}" if step in resumed else ""
            lines.append(f"| {step} | {loss:.5f} | {after} | {fraction:.4f} |")
    for name, error in report.get("errors", {}).items():
        lines += ["", f"**{name} failed**: `{error.splitlines()[-1] if error else ''}`"]
    return "\n".join(lines) + "\n"


def run(rank: int, world: int, args, store: str) -> None:
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    report, errors = {}, {}
    torch_compat()
    try:
        if not cuda:
            use_cpu()
        for part in (["compare", "train"] if args.part == "all" else [args.part]):
            began = time.perf_counter()
            try:
                report[part] = (compare if part == "compare" else train)(args, device)
                report[part]["seconds"] = time.perf_counter() - began
            except Exception:  # noqa: BLE001 - the other part still runs; the error is recorded
                import traceback

                errors[part] = traceback.format_exc()
                print(errors[part], file=sys.stderr, flush=True)
        if rank == 0:
            report["environment"] = environment()
            if errors:
                report["errors"] = errors
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "distmuon_compare.json").write_text(json.dumps(report, indent=1))
            (out / "distmuon_compare.md").write_text(markdown(report))
            print(markdown(report), flush=True)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("compare", "train", "all"), default="all")
    parser.add_argument("--flavor", default=None, help="torchtitan Llama-3 flavor (default: 1B on CUDA, debugmodel on CPU)")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first")
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences of %d tokens)" % SEQ_LEN)
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--world", type=int, default=2, help="gloo ranks on CPU (CUDA: always 1)")
    parser.add_argument("--cpu", action="store_true", help="the CPU/gloo path even where CUDA is present")
    parser.add_argument("--out", default="distmuon-out")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu
    args.flavor = args.flavor or ("1B" if cuda else "debugmodel")
    store = tempfile.mktemp(prefix="dion3-store-")
    if cuda:
        run(0, 1, args, store)
    else:
        import torch.multiprocessing as mp

        mp.spawn(run, args=(args.world, args, store), nprocs=args.world)


if __name__ == "__main__":
    main()
