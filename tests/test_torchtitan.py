"""dion3 in torchtitan 0.3 (dion3.integrations.torchtitan).

The job config of the docs (docs/integrations.md, "## torchtitan") is parsed by torchtitan's own
ConfigManager, and its optimizer and LR-scheduler configs train torchtitan's Llama-3 debug model
on 4 gloo ranks (tests/torchtitan_worker.py): FSDP2 + TP (dp=2, tp=2) against the one-process
model, then DCP save → resume on the same layout and on FSDP2 over 4 ranks against the
uninterrupted run. Group assignment by FQN is checked on the debug models (meta device) of
Llama 3 and of Qwen 3 MoE. Per-shape fractions by cost (fraction_allocation="cost") are checked
against cost_allocated_fractions of the global weight shapes, and trained on FSDP2 over 2 ranks
(save → resume included) against the one-process model.

Everything but the first test needs torchtitan installed (`pip install 'dion3[torchtitan]'`); CI
does not install it (the docs say why), so there these tests are skipped.
"""
from __future__ import annotations

import importlib.util
import math
from collections import Counter
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gloo
import torchtitan_worker as worker

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "integrations.md"
HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
needs_torchtitan = pytest.mark.skipif(not HAVE_TORCHTITAN, reason="torchtitan is not installed (extra 'torchtitan')")


def test_importing_dion3_leaves_torchtitan_alone():
    code = "import sys, dion3, dion3.integrations; print('torchtitan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.stdout.strip() == "False"


def docs_config_source() -> str:
    """The first Python block of the docs' torchtitan section: the config a user writes."""
    text = DOCS.read_text()
    section = text.split("## torchtitan", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def job_config(tmp_path_factory):
    """The docs' config function run through torchtitan's ConfigManager, with a CLI override."""
    from torchtitan.config.manager import ConfigManager

    folder = tmp_path_factory.mktemp("configs")
    (folder / "my_dion3_configs.py").write_text(docs_config_source())
    sys.path.insert(0, str(folder))
    try:
        return ConfigManager().parse_args(
            ["--module", "my_dion3_configs", "--config", "llama3_debugmodel_dion3", "--training.steps", "6"])
    finally:
        sys.path.remove(str(folder))


@needs_torchtitan
def test_docs_config_selects_dion3(job_config):
    from dion3 import FractionWarmup
    from dion3.integrations.torchtitan import Dion3OptimizersContainer

    assert type(job_config.optimizer) is Dion3OptimizersContainer.Config
    assert job_config.optimizer.fraction_schedule == FractionWarmup(target=0.25, steps=4)
    assert [g.optimizer_name for g in job_config.optimizer.param_groups] == ["AdamW", "AdamW", "Dion3", "Dion3"]
    assert job_config.training.steps == 6  # the command line still reaches the rest of the job


def _assignment(container) -> dict[str, tuple]:
    """FQN → (optimizer class, algorithm, lr, weight decay, num_heads) as built."""
    out = {}
    for optimizer in container.optimizers:
        for group in optimizer.param_groups:
            for name in group["param_names"]:
                out[name] = (type(optimizer).__name__, group.get("algorithm"), group["lr"],
                             group["weight_decay"], group.get("num_heads"))
    return out


def _meta_model(spec):
    with torch.device("meta"):
        return spec.model.build()


@needs_torchtitan
@pytest.mark.parametrize("name, algorithm", [("Dion3", "dion3"), ("NorMuon", "normuon"), ("Muon", "muon")])
def test_llama3_groups_by_fqn(name, algorithm):
    from torchtitan.models.llama3 import model_registry

    from dion3.integrations.torchtitan import dion3_optimizer

    spec = model_registry("debugmodel")  # dim 256, 16 heads of 16 (no GQA), fused wqkv
    model = _meta_model(spec)
    built = _assignment(dion3_optimizer(spec.model, algorithm=name, lr=0.02, adamw_lr=1e-3).build(model_parts=[model]))
    assert set(built) == {n for n, _ in model.named_parameters()}
    for fqn, got in built.items():
        if fqn.endswith("norm.weight"):
            expected = ("AdamW", None, 1e-3, 0.0, None)
        elif fqn in ("tok_embeddings.weight", "lm_head.weight"):
            expected = ("AdamW", None, 1e-3, 0.1, None)
        elif fqn.endswith("wqkv.weight"):  # 16 query + 16 key + 16 value heads
            expected = (name, algorithm, 0.02, 0.1, 48)
        else:
            expected = (name, algorithm, 0.02, 0.1, None)
        assert got == expected, fqn


@needs_torchtitan
def test_moe_groups_by_fqn():
    from torchtitan.models.qwen3 import model_registry

    from dion3.integrations.torchtitan import dion3_optimizer

    spec = model_registry("debugmodel_moe")
    model = _meta_model(spec)
    params = dict(model.named_parameters())
    container = dion3_optimizer(spec.model).build(model_parts=[model])
    built = _assignment(container)
    experts = [n for n in built if "inner_experts" in n]
    assert experts and all(params[n].dim() == 3 and built[n][:2] == ("Dion3", "dion3") for n in experts)
    # declared stacks: each expert is its own matrix (a group without stacked=True refuses them)
    stacked = {n for o in container.optimizers for g in o.param_groups if g.get("stacked") for n in g["param_names"]}
    assert set(experts) <= stacked
    routers = [n for n in built if n.endswith("router.gate.weight")]
    assert routers and all(built[n][0] == "AdamW" for n in routers)
    assert all(built[n][:2] == ("AdamW", None) for n in built if params[n].dim() == 1)
    # fused wqkv of 16 query heads and 8 KV heads (head_dim 128): 16 + 2·8 blocks of 128 rows
    qkv = [n for n in built if n.endswith("wqkv.weight")]
    assert qkv and all(built[n][4] == 32 and params[n].shape[0] == 32 * 128 for n in qkv)


@needs_torchtitan
def test_fraction_schedule_needs_a_dion3_group():
    from torchtitan.models.llama3 import model_registry

    from dion3 import FractionWarmup
    from dion3.integrations.torchtitan import dion3_optimizer

    spec = model_registry("debugmodel")
    config = dion3_optimizer(spec.model, algorithm="Muon", fraction_schedule=FractionWarmup(target=0.25, steps=4))
    with pytest.raises(ValueError, match="no parameter group runs Dion3"):
        config.build(model_parts=[_meta_model(spec)])


@needs_torchtitan
def test_a_vector_in_the_orthogonal_group_is_refused_by_name():
    from torch import nn

    from dion3.integrations.torchtitan import dion3_optimizer

    model = nn.Module()
    model.tok_embeddings = nn.Embedding(16, 8)
    model.norm = nn.LayerNorm(8, bias=False)
    model.proj = nn.Linear(8, 8, bias=False)
    model.gate_scale = nn.Parameter(torch.ones(8))  # 1-D, matched by no AdamW pattern
    with pytest.raises(ValueError, match="gate_scale"):
        dion3_optimizer().build(model_parts=[model])


@pytest.fixture(scope="module")
def runs(job_config, tmp_path_factory):
    assert job_config.training.steps == worker.STEPS
    return gloo.spawn_and_read(worker.worker, 4, tmp_path_factory.mktemp("torchtitan") / "results.json",
                               job_config.optimizer, job_config.lr_scheduler)


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@needs_torchtitan
def test_debug_model_trains_with_the_docs_config(runs):
    losses = runs["a"]["losses"]
    assert runs["a"]["kinds"] == ["AdamW", "Dion3"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.2, losses


@needs_torchtitan
def test_fsdp_tp_matches_one_process(runs):
    # Dion3 with global selection: the update does not depend on the layout; what differs is the
    # order of float32 sums in FSDP2's reductions and TP's matmuls
    assert _relative(runs["a"]["losses"], runs["reference"]["losses"]) < 1e-5


@needs_torchtitan
def test_schedules_follow_their_definitions(runs):
    # FractionWarmup(target=0.25, steps=4) from 1.0, the fraction each step used (steps 0..5)
    assert runs["a"]["fractions"] == pytest.approx([1 - 0.75 * min(s, 4) / 4 for s in range(6)])
    # the debug config's LR schedule over 6 steps: 2 warmup steps, 1 stable, 3 of linear decay
    # (decay_ratio 0.8 → 5 decay steps, cut to 4 so that warmup + decay fit in 6; lr × (1 − k/4))
    assert runs["a"]["lrs"] == pytest.approx([0.02 * f for f in (0.5, 1.0, 1.0, 0.75, 0.5, 0.25)])


@needs_torchtitan
def test_resume_on_the_same_layout_continues_exactly(runs):
    tail = slice(worker.SAVE_AT, None)
    assert runs["b"]["losses"] == runs["a"]["losses"][tail]
    assert runs["b"]["fractions"] == runs["a"]["fractions"][tail]
    assert runs["b"]["lrs"] == runs["a"]["lrs"][tail]


@needs_torchtitan
def test_resume_on_fsdp_over_four_ranks_continues_the_trajectory(runs):
    tail = slice(worker.SAVE_AT, None)
    assert _relative(runs["c"]["losses"], runs["a"]["losses"][tail]) < 1e-5
    assert runs["c"]["fractions"] == runs["a"]["fractions"][tail]


# --- per-shape fractions by cost (fraction_allocation="cost") ---------------------------------

def _expected_cost_fractions(model, fraction: float, allocation: str = "cost") -> dict[str, float]:
    """FQN → fraction for the Dion3 parameters of the debug model under `allocation` ("cost" or
    "most_rows"), from its global weight shapes: cost_allocated_fractions over the orthogonal
    group's shapes; the fused wqkv (per-head blocks) keeps `fraction`."""
    from dion3.tools.bench.step_cost import MatrixShape
    from dion3.optim.cost_fractions import cost_allocated_fractions

    orthogonal = {n: tuple(p.shape) for n, p in model.named_parameters()
                  if p.dim() == 2 and not re.search(r"(tok_embeddings|output|lm_head)\.|wqkv", n)}
    counts = Counter(orthogonal.values())
    shapes = [MatrixShape(f"{r}x{c}", r, c, count) for (r, c), count in counts.items()]
    by_shape = dict(zip(counts, cost_allocated_fractions(shapes, fraction, most_rows=allocation == "most_rows")))
    expected = {n: by_shape[shape] for n, shape in orthogonal.items()}
    expected.update({n: fraction for n, _ in model.named_parameters() if n.endswith("wqkv.weight")})
    return expected


def _cost_config(fraction: float = 0.25, allocation: str = "cost"):
    from torchtitan.models.llama3 import model_registry

    from dion3.integrations.torchtitan import dion3_optimizer

    return dion3_optimizer(model_registry("debugmodel").model, lr=0.02, adamw_lr=3e-3, fraction=fraction,
                           selection_scope="global", fraction_allocation=allocation)


# the debug model's wo 256×256, w1/w3 768×256, w2 256×768: "cost" at ¼ gives 1, 1/6, ½; "most_rows"
# at ½ gives ½ to all three where "cost" gives 1, 1/6, 0.79 (the most rows ½'s modeled time buys)
ALLOCATIONS = [("cost", 0.25), ("most_rows", 0.5)]


@needs_torchtitan
@pytest.mark.parametrize("allocation, fraction", ALLOCATIONS)
def test_cost_allocation_splits_the_orthogonal_group_by_shape(allocation, fraction):
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    model = _meta_model(spec)
    container = _cost_config(fraction, allocation).build(model_parts=[model])
    dion3_groups = [g for o in container.optimizers if type(o).__name__ == "Dion3" for g in o.param_groups]
    built = {name: g["fraction"] for g in dion3_groups for name in g["param_names"]}
    expected = _expected_cost_fractions(model, fraction, allocation)
    assert built == expected
    params = dict(model.named_parameters())
    for group in dion3_groups:  # one group per shape (wqkv: its own group, by pattern)
        assert len({tuple(params[n].shape) for n in group["param_names"]}) == 1
        assert [params[n] for n in group["param_names"]] == list(group["params"])
    others = {f for n, f in expected.items() if not n.endswith("wqkv.weight")}
    if allocation == "most_rows":  # the two rules split this model differently at ½
        assert expected != _expected_cost_fractions(model, fraction, "cost") and others == {0.5}
        return
    assert len(others) == 3 and 0.25 not in others  # wo 256×256, w1/w3 768×256, w2 256×768
    # "uniform" (the default) keeps one fraction on both orthogonal groups, as before
    from dion3.integrations.torchtitan import dion3_optimizer

    uniform = dion3_optimizer(spec.model, lr=0.02, fraction=0.25).build(model_parts=[model])
    groups = [g for o in uniform.optimizers if type(o).__name__ == "Dion3" for g in o.param_groups]
    assert len(groups) == 2 and {g["fraction"] for g in groups} == {0.25}


@needs_torchtitan
@pytest.mark.parametrize("kwargs, message", [
    ({"fraction_allocation": "cost"}, "needs fraction="),
    ({"fraction_allocation": "cost", "fraction": 0.25, "algorithm": "Muon"}, "needs algorithm='Dion3'"),
    ({"fraction_allocation": "cost", "fraction": 0.25, "fraction_schedule": "warmup"},
     "fraction_schedule cannot be combined"),
    ({"fraction_allocation": "by_cost", "fraction": 0.25}, "fraction_allocation must be one of"),
    ({"fraction_allocation": "most_rows"}, "fraction_allocation='most_rows' needs fraction="),
    ({"fraction_allocation": "most_rows", "fraction": 0.5, "algorithm": "NorMuon"}, "needs algorithm='Dion3'"),
])
def test_dion3_optimizer_refuses_bad_cost_settings(kwargs, message):
    from torchtitan.models.llama3 import model_registry

    from dion3 import FractionWarmup
    from dion3.integrations.torchtitan import dion3_optimizer

    if kwargs.get("fraction_schedule") == "warmup":
        kwargs = dict(kwargs, fraction_schedule=FractionWarmup(target=0.25, steps=4))
    with pytest.raises(ValueError, match=re.escape(message)):
        dion3_optimizer(model_registry("debugmodel").model, **kwargs)


@needs_torchtitan
@pytest.mark.parametrize("algorithm, options, schedule, message", [
    ("Muon", {"fraction": 0.25}, False, "no parameter group runs Dion3 or Dion2"),
    ("Dion3", {}, False, "needs a fraction in the group of pattern '.*'"),
    ("Dion3", {"fraction": 0.25}, True, "fraction_schedule cannot be combined"),
])
def test_container_refuses_bad_cost_settings(algorithm, options, schedule, message):
    from torchtitan.models.llama3 import model_registry

    from dion3 import FractionWarmup
    from dion3.integrations.torchtitan import Dion3OptimizersContainer, param_group_configs

    spec = model_registry("debugmodel")
    config = Dion3OptimizersContainer.Config(
        param_groups=param_group_configs(algorithm, **options), implementation="foreach",
        fraction_allocation="cost", fraction_schedule=FractionWarmup(target=0.25, steps=4) if schedule else None)
    with pytest.raises(ValueError, match=re.escape(message)):
        config.build(model_parts=[_meta_model(spec)])


@pytest.fixture(scope="module", params=ALLOCATIONS, ids=[a for a, _ in ALLOCATIONS])
def cost_runs(request, job_config, tmp_path_factory):
    allocation, fraction = request.param
    runs = gloo.spawn_and_read(worker.cost_worker, 2, tmp_path_factory.mktemp(f"torchtitan_{allocation}") / "results.json",
                               _cost_config(fraction, allocation), job_config.lr_scheduler)
    return dict(runs, allocation=allocation, fraction=fraction)


@needs_torchtitan
def test_cost_fractions_on_fsdp_match_one_process_and_resume(cost_runs):
    from torchtitan.models.llama3 import model_registry

    a, b, ref = cost_runs["a"], cost_runs["b"], cost_runs["reference"]
    # the groups come from global shapes: the same on FSDP2 (dim-0 shards), on one process and
    # after loading the checkpoint (each parameter's group settings are saved under its FQN)
    expected = _expected_cost_fractions(_meta_model(model_registry("debugmodel")), cost_runs["fraction"],
                                        cost_runs["allocation"])
    assert a["fraction_by_fqn"] == ref["fraction_by_fqn"] == b["fraction_by_fqn"] == pytest.approx(expected)
    assert all(math.isfinite(x) for x in a["losses"]) and a["losses"][-1] < a["losses"][0] - 0.2
    # global selection: the same update on any layout up to the order of float32 sums, which a
    # fixed fraction 0.25 from step 1 amplifies more than the docs' warmup from 1.0 (measured
    # 2.7e-6; with bf16 Newton–Schulz 1.2e-5, and 4e-6 for the uniform fraction); cost against
    # uniform fractions moves the losses by about 8e-4
    assert _relative(a["losses"], ref["losses"]) < 5e-5
    assert b["losses"] == a["losses"][worker.SAVE_AT:]
