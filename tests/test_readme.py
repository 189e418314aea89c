"""The README's usage example runs as written: on a small GPT it builds an optimizer that holds
every model parameter exactly once, and three steps move every weight."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from dion3.tools.train.model import GPT, GPTConfig

README = Path(__file__).resolve().parent.parent / "README.md"


def _usage_examples() -> list[str]:
    text = README.read_text()
    start = text.index("## Usage")
    usage = text[start:text.index("\n## ", start)]
    return re.findall(r"```python\n(.*?)```", usage, flags=re.S)


def test_the_usage_section_has_one_example():
    # one way in: a second snippet built by hand drifted from param_groups once
    assert len(_usage_examples()) == 1


def test_the_usage_example_builds_an_optimizer_over_every_parameter_once():
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32, vocab_size=256))
    namespace = {"model": model}
    exec(_usage_examples()[0], namespace)
    optimizer = namespace["optimizer"]
    held = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(held) == sorted(id(p) for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    # the head and the output projections start at zero: gradients reach the norms' gains at step 3
    for _ in range(3):
        tokens = torch.randint(0, 256, (4, 16))
        model(tokens, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(not torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
