"""examples/hf_trainer.py under transformers.Trainer (CPU, a tiny LlamaForCausalLM): a run saved
after step 4 and resumed from that checkpoint folder in a new Trainer continues on the same
trajectory as the uninterrupted run, the fraction schedule included.

Equality is exact, not to a tolerance: the resumed Trainer restores every input of steps 5-8 bit
for bit (weights from model.safetensors, the optimizer's float32 state from optimizer.pt, the LR
schedule from scheduler.pt, the data order and RNG states, and the fraction schedule's step count
from trainer_state.json), and one CPU process runs the same operations in the same order.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("hf_trainer", ROOT / "examples" / "hf_trainer.py")
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


class Fractions(TrainerCallback):
    """The fraction of the Dion3 group that each optimizer step uses."""

    def __init__(self):
        self.seen = []

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.seen.append(optimizer.param_groups[0]["fraction"])


def _run(model, output_dir, resume_from=None):
    trainer = example.make_trainer(model, str(output_dir))
    fractions = Fractions()
    trainer.add_callback(fractions)
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer, fractions.seen


def test_resume_from_the_trainers_checkpoint_continues_the_trajectory(tmp_path):
    saved = example.SAVE_EVERY
    whole, whole_fractions = _run(example.tiny_llama(), tmp_path)
    assert (tmp_path / f"checkpoint-{saved}" / "optimizer.pt").exists()
    dion = whole.optimizer.optimizer  # the Trainer wraps it in accelerate's AcceleratedOptimizer
    assert isinstance(dion, example.dion3.Dion3) and dion.param_groups[0]["algorithm"] == "dion3"
    # the fraction warms up from 1 to ¼ across the checkpoint: restarting the schedule would show
    assert whole_fractions == [example.dion3.FractionWarmup(target=0.25, steps=6)(s) for s in range(example.STEPS)]
    assert whole_fractions[saved - 1] != whole_fractions[saved] != whole_fractions[0]

    other = example.tiny_llama(seed=1)  # other weights: the checkpoint must replace them
    resumed, resumed_fractions = _run(other, tmp_path, resume_from=str(tmp_path / f"checkpoint-{saved}"))
    assert resumed_fractions == whole_fractions[saved:]
    losses, again = example.losses(whole), example.losses(resumed)
    assert len(losses) == example.STEPS and again[:saved] == losses[:saved]  # steps 1-4: the checkpoint's log
    assert again[saved:] == losses[saved:], (again, losses)  # steps 5-8: trained anew
    assert losses[-1] < losses[0]
    for (name, a), b in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name


def test_docs_show_the_example_script():
    """docs/integrations.md shows examples/hf_trainer.py verbatim."""
    script = (ROOT / "examples" / "hf_trainer.py").read_text()
    assert f"```python\n{script}```" in (ROOT / "docs" / "integrations.md").read_text()
