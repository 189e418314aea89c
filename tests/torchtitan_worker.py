"""Spawned ranks of tests/test_torchtitan.py (gloo, CPU): torchtitan's Llama-3 debug model trained
with the optimizer and LR-scheduler configs of a torchtitan job config, through torchtitan's own
pieces in its trainer's order — model config → meta build → `parallelize_llama` (FSDP2 + TP) →
`init_weights` → `config.optimizer.build` → `config.lr_scheduler.build` → CheckpointManager (DCP).

torchtitan's Trainer itself needs CUDA (it picks "cuda" when no accelerator is found), so the CPU
run drives those pieces directly, with three CPU-only adjustments: ParallelDims builds its meshes
on "cpu"; attention runs on SDPA (torchtitan's ScaledDotProductAttention, as its own graph_trainer
tests do) instead of FlexAttention, which torch.compile would have to build on every rank; FSDP
reduces with a plain sum (`set_force_sum_reduction_for_comms`) because torchtitan sets a gradient
divide factor of 1, which FSDP2 sends as PREMUL_SUM, an op gloo lacks — the same sum either way.

Runs: "a" trains STEPS steps on (dp=2, tp=2) and saves a checkpoint at SAVE_AT; "b" starts from
a different initialization on the same layout, loads that checkpoint and trains the remaining
steps; "c" does the same on FSDP2 over 4 ranks (dp=4, tp=1); rank 0 also trains the plain
one-process model ("reference") on the same global batches from the same weights.
`cost_worker` (2 ranks) does "a" and "b" on FSDP2 (dp=2) and the reference for a config with
per-shape fractions by cost; every run records the fraction of each Dion3 parameter's group.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gloo

STEPS = 6
SAVE_AT = 3
GLOBAL_BATCH = 4
SEQ_LEN = 32
TOKENS_USED = 64  # the batches draw from the first 64 of the 2048 token ids: a learnable unigram law


def use_cpu() -> None:
    """torchtitan resolves its device type at import ("cuda" when no accelerator is found)."""
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tools

    tools.device_type = "cpu"
    parallel_dims.device_type = "cpu"


def debug_model_spec():
    """The debug model's spec with SDPA attention and RoPE tables of SEQ_LEN positions (the
    trainer sizes them to training.seq_len the same way)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ_LEN)
    return spec


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, TOKENS_USED, (GLOBAL_BATCH, SEQ_LEN + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def summed_loss(logits, labels) -> torch.Tensor:
    """Cross-entropy summed over the tokens here, divided by the global token count (torchtitan's
    normalization), so that gradients summed over the data-parallel ranks are the global mean's."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):  # vocabulary-parallel under TP
        logits = logits.full_tensor()
    total = GLOBAL_BATCH * SEQ_LEN
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / total


def build_parallel(dp: int, tp: int, folder: str):
    """The debug model on meta, parallelized by torchtitan on (dp, tp). The sharding plan is set
    as Llama3Model.Config.update_from_config sets it (that method also imports the whole trainer,
    datasets and all, which these ranks do not need)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    spec = debug_model_spec()
    parallelism = ParallelismConfig(data_parallel_shard_degree=dp, tensor_parallel_degree=tp,
                                    spmd_backend="partial_dtensor")
    training = TrainingConfig(local_batch_size=GLOBAL_BATCH // dp, seq_len=SEQ_LEN, steps=STEPS,
                              mixed_precision_param="float32")
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    dims.build_mesh()
    set_llama3_sharding_config(spec.model, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = spec.model.build()
    model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder=folder)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model, dims


def train(optimizer_config, scheduler_config, dp: int, tp: int, seed: int, folder: str,
          first: int, save_at: int | None = None, load_step: int | None = None) -> dict:
    from torchtitan.components.checkpoint import CheckpointManager

    model, dims = build_parallel(dp, tp, folder)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = scheduler_config.build(optimizers=optimizers, training_steps=STEPS)
    checkpointer = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=save_at or STEPS + 1, keep_latest_k=0,
        last_save_model_only=False, load_only=save_at is None,
    ).build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
            states={}, sd_adapter=None, base_folder=folder)
    if load_step is not None:
        assert checkpointer.load(step=load_step)
    initial = {name: p.full_tensor() for name, p in model.named_parameters()}
    dp_rank = dims.get_mesh("fsdp").get_local_rank() if dp > 1 else 0
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    record = {"losses": [], "fractions": [], "lrs": []}
    for step in range(first, STEPS + 1):
        inputs, labels = batch(step)
        optimizers.zero_grad()
        loss = summed_loss(model(inputs[rows]), labels[rows])
        loss.backward()
        record["fractions"].append(_dion3_group(optimizers)["fraction"])
        record["lrs"].append(float(_dion3_group(optimizers)["lr"]))
        optimizers.step()
        schedulers.step()
        checkpointer.save(curr_step=step)
        total = loss.detach().clone()
        dist.all_reduce(total)
        record["losses"].append(total.item() / tp)  # the tp ranks of a dp rank hold the same loss
    record["kinds"] = sorted({type(o).__name__ for o in optimizers})
    record["fraction_by_fqn"] = _fraction_by_fqn(optimizers)
    checkpointer.close()
    return record, initial


def _fraction_by_fqn(optimizers) -> dict:
    """FQN → the fraction of its group, over the Dion3 groups (after loading: as restored)."""
    return {name: group["fraction"] for o in optimizers for group in o.param_groups
            if group.get("algorithm") == "dion3" for name in group["param_names"]}


def _dion3_group(optimizers) -> dict:
    return next(g for o in optimizers for g in o.param_groups if g.get("algorithm") == "dion3")


def reference(optimizer_config, scheduler_config, initial: dict) -> dict:
    """The plain one-process model from the same weights on the whole global batches."""
    spec = debug_model_spec()
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, p in model.named_parameters():
            p.copy_(initial[name])
    model.train()
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = scheduler_config.build(optimizers=optimizers, training_steps=STEPS)
    losses = []
    for step in range(1, STEPS + 1):
        inputs, labels = batch(step)
        optimizers.zero_grad()
        loss = summed_loss(model(inputs), labels)
        loss.backward()
        optimizers.step()
        schedulers.step()
        losses.append(loss.item())
    return {"losses": losses, "fraction_by_fqn": _fraction_by_fqn(optimizers)}


def _run_scenarios(rank: int, world: int, out_path: str, optimizer_config, scheduler_config,
                   layout: tuple[int, int], resumes: dict[str, tuple[int, int]]) -> None:
    """"a" trains on `layout` (dp, tp) and saves at SAVE_AT; each of `resumes` (name → layout)
    resumes from that checkpoint; rank 0 also trains the one-process reference."""
    folder = os.path.dirname(out_path)
    torch.set_num_threads(1)

    def scenarios() -> dict:
        use_cpu()
        a, initial = train(optimizer_config, scheduler_config, *layout, seed=0, folder=f"{folder}/a",
                           first=1, save_at=SAVE_AT)
        results = {"a": a}
        for seed, (name, (dp, tp)) in enumerate(resumes.items(), start=1):
            results[name], _ = train(optimizer_config, scheduler_config, dp, tp, seed=seed, folder=f"{folder}/a",
                                     first=SAVE_AT + 1, load_step=SAVE_AT)
        if rank == 0:
            results["reference"] = reference(optimizer_config, scheduler_config, initial)
        return results

    gloo.run_and_report(rank, world, out_path, scenarios)


def worker(rank: int, world: int, out_path: str, optimizer_config, scheduler_config) -> None:
    """FSDP2 + TP (dp=2, tp=2) saves; "b" resumes on the same layout, "c" on FSDP2 over 4 ranks."""
    _run_scenarios(rank, world, out_path, optimizer_config, scheduler_config, (2, 2), {"b": (2, 2), "c": (4, 1)})


def cost_worker(rank: int, world: int, out_path: str, optimizer_config, scheduler_config) -> None:
    """FSDP2 over 2 ranks: "a" saves at SAVE_AT, "b" resumes from it on the same layout; rank 0
    also trains the one-process reference."""
    _run_scenarios(rank, world, out_path, optimizer_config, scheduler_config, (2, 1), {"b": (2, 1)})
