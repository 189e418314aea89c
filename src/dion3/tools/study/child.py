"""One run of the study, in its own process (`python -m dion3.tools.study --run-one ...`): build
the model and the data, train, and return the record that results.jsonl keeps."""
from __future__ import annotations

import dataclasses
import math
import platform
import shutil
import statistics
import subprocess
import time
from typing import Callable, Optional

from .runs import MODELS, ModelSpec, Run, parse_fraction_weights


def build_llama(spec: ModelSpec):
    """A factory for the trainer: Hugging Face LlamaForCausalLM of `spec`'s shape, mapping
    (tokens, targets) to the mean loss, with its head exposed as `lm_head`."""
    import torch.nn.functional as F
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    class CausalLM(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.llama = LlamaForCausalLM(LlamaConfig(
                vocab_size=config.vocab_size, hidden_size=spec.d_model, intermediate_size=spec.mlp_width,
                num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head, num_key_value_heads=spec.kv_heads,
                max_position_embeddings=spec.seq_len, tie_word_embeddings=False, attn_implementation="sdpa",
            ))

        @property
        def lm_head(self):
            return self.llama.lm_head

        def forward(self, tokens, targets):
            logits = self.llama(input_ids=tokens).logits
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return CausalLM


# progress lines per run (its log shows how far a run that is stopped had come)
PROGRESS_LINES = 10


def progress_printer(steps: int, lines: int = PROGRESS_LINES, sample: Optional[Callable[[], Optional[int]]] = None,
                     samples: Optional[list] = None, skipped: Optional[Callable[[], Optional[int]]] = None):
    """An on_step callback that prints `lines` lines over `steps` steps: the step, the minutes
    since the first step and an estimate of the minutes left (host clock). With `sample` (e.g.
    gpu_process_count), each line also calls it, appends its answer to `samples` and prints it.
    With `skipped` (the optimizer's skip counter: one device sync a line), each line prints the
    updates skipped so far, so the log of a run that dies keeps how many it had skipped."""
    every = max(1, steps // lines)
    started = time.perf_counter()
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if done % every == 0 or done == steps:
            minutes = (time.perf_counter() - started) / 60
            line = f"step {done}/{steps}: {minutes:.1f} min, about {minutes * (steps - done) / done:.1f} min left"
            if sample is not None:
                count = sample()
                if samples is not None:
                    samples.append(count)
                line += f", {'?' if count is None else count} processes on the GPU"
            if skipped is not None:
                so_far = skipped()
                line += f", {'?' if so_far is None else so_far} updates skipped so far"
            print(line, flush=True)
    return step


def gpu_process_count(device) -> Optional[int]:
    """How many processes hold a context on `device`'s GPU now, from `nvidia-smi` (this one
    included): other study runs, or anything else sharing the GPU, which can corrupt products
    (benchmarks/results/nonfinite-h200-2026-12-02.md). None off CUDA, without nvidia-smi, or
    when it fails. A study starts one process per run, so its own count (runs_at_once) says
    nothing of runs that other studies started on the same GPU."""
    import torch

    if device.type != "cuda" or shutil.which("nvidia-smi") is None:
        return None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    try:
        listing = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",")[0].strip().lower() for line in listing.splitlines() if line.strip()]
    # nvidia-smi writes "GPU-<uuid>"; torch's uuid has no prefix
    count = sum(1 for gpu in rows if uuid is None or gpu.removeprefix("gpu-") == str(uuid).lower())
    # this process holds a context there, so 0 means nvidia-smi cannot see processes here (a container's
    # PID namespace) or the names did not match: unknown, not "alone"
    return count or None


def run_one(run: Run, device_name: str, threads: Optional[int]) -> dict:
    import torch

    from dion3.tools.train.corpus import python_source_corpus
    from dion3.tools.train.data import load_data
    from dion3.tools.train.model import GPT, GPTConfig
    from dion3.tools.train.trainer import RunSpec, Schedule, resolve_device, train

    if threads:
        torch.set_num_threads(threads)
    spec = MODELS[run.model]
    device = resolve_device(device_name)
    if run.data is None:
        data = python_source_corpus(progress=lambda line: print(line, flush=True))
    else:
        data = load_data(None if run.data == ("stdlib",) else list(run.data))
    config = GPTConfig(seq_len=spec.seq_len, n_layer=spec.n_layer, n_head=spec.n_head, d_model=spec.d_model)
    factory = GPT if spec.kind == "gpt" else build_llama(spec)
    schedule = Schedule(steps=run.horizon, batch_size=run.batch_size, eval_every=run.horizon, eval_batches=run.eval_batches,
                        warmup_steps=run.lr_warmup, cooldown_fraction=run.cooldown, read_once=run.read_once)
    # AdamW has no μ (its betas stay the defaults)
    run_spec = RunSpec(run.label, run.optimizer, run.lr, run.fraction, run.mu if run.optimizer != "adamw" else None,
                       run.fraction_warmup, run.fraction_allocation, run.momentum_dtype if run.optimizer != "adamw" else None,
                       run.row_score if run.optimizer == "dion3" else None,
                       parse_fraction_weights(run.fraction_weights) if run.optimizer == "dion3" else None,
                       run.ns_coefficients if run.optimizer != "adamw" else None,
                       unselected_decay=run.unselected_decay if run.optimizer == "dion3" else None,
                       full_every=run.full_every if run.optimizer == "dion3" else 0)
    started = time.perf_counter()
    sharing: list = []  # processes on the GPU at each progress line
    built: dict = {}  # the run's optimizer, once train has built it
    on_step = progress_printer(run.horizon, sample=lambda: gpu_process_count(device), samples=sharing,
                               skipped=lambda: int(built["optimizer"].nonfinite_updates) if built else None)
    result = train(run_spec, config, schedule, data, device, run.seed, bf16=True, model_factory=factory, captured=run.captured,
                   compiled=run.compiled, on_step=on_step, on_optimizer=lambda optimizer: built.update(optimizer=optimizer))
    counted = [n for n in sharing if n is not None]
    return {
        "key": run.key, "config": dataclasses.asdict(run), "seed": run.seed, "horizon": run.horizon,
        "final_val_loss": result.final_val_loss,
        # the train/validation gap shows when a long horizon starts to overfit the repeated data
        "final_train_loss": statistics.fmean(result.train_losses[-50:]),
        "average_fraction": result.average_fraction if run.optimizer == "dion3" else 1.0,
        "optimizer_ms_median": result.optimizer_ms_median, "optimizer_ms_mean": result.optimizer_ms,
        "total_ms_mean": result.total_ms, "minutes": (time.perf_counter() - started) / 60,
        # executed orthogonalization FLOPs of all steps at each step's fractions, counted on the host with
        # `dion3 bench`'s H200 model (symmetric kernels from n ≥ SYMMETRIC_MIN_N, flops.h200_symmetric)
        # whatever the device: AdamW 0, Muon/NorMuon every row, Dion3 ⌈f·rows⌉ rows per matrix
        "optimizer_tflop": result.optimizer_flops / 1e12,
        "device": str(device), "torch": torch.__version__, "data": data.description,
        # quality is compared within one card kind: the record names the card that ran it
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        # the first step whose training loss was not finite (None: every step finite)
        "first_nonfinite_step": next((i for i, v in enumerate(result.train_losses) if not math.isfinite(v)), None),
        "nonfinite_updates": result.nonfinite_updates,
        "skipped_update_steps": result.skipped_update_steps,
        "nonfinite_parameters": result.nonfinite_parameters,
        # the most processes seen on the GPU at the progress lines (None: not counted, e.g. on a CPU)
        "gpu_processes_max": max(counted) if counted else None,
    }


