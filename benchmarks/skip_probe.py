"""Probe (not kept): does Muon llama-384 lr 0.01 mu 0.8 seed 0 skip an update when alone on the GPU?
Saves the orthogonalization input and output of every matrix the guard rejects."""
import dataclasses, json, math, os, sys, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
import dion3.rules as rules
from dion3.ortho.padding import Padded
from dion3.tools import study
from dion3.tools.train import trainer

OUT = os.environ.get("OUT", "/tmp/probe"); os.makedirs(OUT, exist_ok=True)
STEPS = int(os.environ.get("PROBE_STEPS", "80"))
state = {"step": 0, "last": None, "skips": [], "max_ratio": 0.0, "tag": ""}
orig_orth, orig_guard = rules.orthogonalize_rows, rules.guard

def orth(update, method, coefficients, norm=None, normalized=False):
    data = update.data if isinstance(update, Padded) else update
    state["last"] = dict(input=data.detach().clone(), method=method, coefficients=coefficients, norm=None if norm is None else norm.detach().clone(), normalized=normalized,
                         rows=getattr(update, "rows", None), cols=getattr(update, "cols", None))
    return orig_orth(update, method, coefficients, norm=norm, normalized=normalized)

def guard(ortho, variance, rows, cfg, bound):
    bound = bound * float(os.environ.get("PROBE_BOUND_SCALE", "1"))
    out = orig_guard(ortho, variance, rows, cfg, bound)
    ok = out[1]
    norms = rules.frobenius_norms(ortho).reshape(-1) / math.sqrt(min(ortho.shape[-2:]))
    state["max_ratio"] = max(state["max_ratio"], float(norms[torch.isfinite(norms)].max()) / bound if torch.isfinite(norms).any() else 0)
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten().tolist()
        rec = dict(step=state["step"], bad=bad, norms_over_sqrt=[float(norms[i]) for i in bad], bound=bound, shape=list(ortho.shape),
                   method=state["last"]["method"], finite=[bool(torch.isfinite(ortho[i]).all()) for i in bad])
        state["skips"].append(rec); print("SKIP", rec, flush=True)
        torch.save(dict(rec=rec, last=state["last"], ortho=ortho.detach().clone()), f"{OUT}/skip-{state['tag']}-{state['step']}-{len(state['skips'])}.pt")
    return out

rules.orthogonalize_rows, rules.guard = orth, guard
orig_train = trainer.train
class Stop(Exception): pass
def train(*a, **k):
    def on_step():
        state["step"] += 1
        if state["step"] >= STEPS: raise Stop
    k["on_step"] = on_step
    return orig_train(*a, **k)
study.train = trainer.train = train  # run_one imports train from trainer at call time

results = []
for tag, dtype in [x.split(":") for x in os.environ.get("PROBE_RUNS", "a:none,b:none,c:none").split(",")]:
    state.update(step=0, skips=[], max_ratio=0.0, tag=tag)
    run = study.Run(model=os.environ.get("PROBE_MODEL", "llama-384"), optimizer="muon", lr=0.01, mu=0.8, fraction=None, fraction_warmup=0, horizon=1500, seed=0,
                    batch_size=16, lr_warmup=50, cooldown=0.3, eval_batches=16, data=(("stdlib",) if os.environ.get("PROBE_DEVICE") == "cpu" else None), compiled=os.environ.get("PROBE_DEVICE") != "cpu",
                    momentum_dtype=None if dtype == "none" else dtype)
    try:
        study.run_one(run, os.environ.get("PROBE_DEVICE", "cuda"), None)
    except Stop:
        pass
    r = dict(tag=tag, dtype=dtype, steps=state["step"], skips=state["skips"], max_ratio_good=state["max_ratio"]); results.append(r)
    print("RUN", json.dumps(r), flush=True)
json.dump(results, open(f"{OUT}/probe.json", "w"), indent=1)
