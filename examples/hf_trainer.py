# Hugging Face Trainer with a dion3 optimizer: dion3.param_groups, an LR schedule, the fraction
# schedule stepped by a TrainerCallback, and a resume from the Trainer's own checkpoint folder.
# run:  python examples/hf_trainer.py [OUTPUT_DIR]    (CPU, seconds; needs transformers and accelerate)
# This toy run warms the fraction up to show the schedule surviving a resume. For a real run, the
# measured settings (README "Which setting", benchmarks/results/frontier/), fixed fractions, no FractionScheduler:
#   dion3.Dion3(dion3.param_groups(model, lm_head="lm_head", lr=0.02, mu=0.6, fraction=0.375, fraction_allocation="cost"))
#   (fraction 0.5 or 0.25 for the other two; which pays off for a run: dion3 plan --tokens-per-step)
import sys

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments,
                          get_cosine_schedule_with_warmup)

import dion3

STEPS = 8  # optimizer steps of the whole run
SAVE_EVERY = 4  # a checkpoint folder OUTPUT_DIR/checkpoint-4, checkpoint-8


class FractionCallback(TrainerCallback):
    """Step a dion3.FractionScheduler after every optimizer step, as the Trainer steps its LR
    scheduler. The scheduler's state is its step count, which the checkpoint already holds
    (global_step in trainer_state.json): a resumed run loads it when training begins, after the
    Trainer restored the optimizer (optimizer.pt) and the LR scheduler (scheduler.pt)."""

    def __init__(self, fractions: dion3.FractionScheduler):
        self.fractions = fractions

    def on_train_begin(self, args, state, control, **kwargs):
        self.fractions.load_state_dict({**self.fractions.state_dict(), "last_step": state.global_step})

    def on_step_end(self, args, state, control, **kwargs):
        self.fractions.step()


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


class Counting(torch.utils.data.Dataset):
    """Token sequences counting up (mod the vocabulary) from a random start by a random stride."""

    def __init__(self, size: int = 256, length: int = 32, vocab: int = 64, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab, (size, 1), generator=gen)
        stride = torch.randint(1, 4, (size, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(length)) % vocab

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def make_trainer(model: LlamaForCausalLM, output_dir: str, steps: int = STEPS) -> Trainer:
    # Matrices: Dion3 (the class picks the rule); embeddings, head and norms: AdamW groups.
    optimizer = dion3.Dion3(dion3.param_groups(model, lm_head="lm_head", lr=0.02, mu=0.6), fraction=0.25)
    lr_schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps)
    fractions = dion3.FractionScheduler(optimizer, dion3.FractionWarmup(target=0.25, steps=6))  # f: 1 → ¼
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8,
                             save_steps=SAVE_EVERY, logging_steps=1, report_to="none", use_cpu=True,
                             disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=Counting(), optimizers=(optimizer, lr_schedule),
                   callbacks=[FractionCallback(fractions)])


def losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


if __name__ == "__main__":
    output_dir = sys.argv[1] if len(sys.argv) > 1 else "hf-trainer-run"
    whole = make_trainer(tiny_llama(), output_dir)
    whole.train()  # 8 steps; checkpoints after steps 4 and 8
    # A new Trainer (another model init: the checkpoint's weights replace it) resumes after step 4;
    # its log history starts with the checkpoint's entries for steps 1-4.
    resumed = make_trainer(tiny_llama(seed=1), output_dir)
    resumed.train(resume_from_checkpoint=f"{output_dir}/checkpoint-{SAVE_EVERY}")
    print("steps 5-8, whole run:", losses(whole)[SAVE_EVERY:])
    print("steps 5-8, resumed:  ", losses(resumed)[SAVE_EVERY:])
    print("same trajectory:", losses(resumed) == losses(whole))
