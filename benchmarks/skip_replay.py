"""Probe (not kept): replay each saved rejected orthogonalization alone on the GPU and in float64."""
import glob, json, math, os, sys, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))
import dion3.rules as rules
OUT = os.environ.get("OUT", "/tmp/probe")
report = []
for path in sorted(glob.glob(f"{OUT}/skip-*.pt")):
    d = torch.load(path, weights_only=False); last = d["last"]; rec = d["rec"]
    x = last["input"]
    bound = rec["bound"]
    bad_counts = 0; worst = 0.0
    for _ in range(int(os.environ.get("REPLAYS", "100"))):
        o = rules.orthogonalize_rows(x.clone(), last["method"], last["coefficients"], norm=last["norm"], normalized=last["normalized"])
        r = (rules.frobenius_norms(o).reshape(-1) / math.sqrt(min(o.shape[-2:])))
        bad_counts += int((~(r <= bound)).sum()); worst = max(worst, float(r[torch.isfinite(r)].max()))
    o64 = rules.orthogonalize_rows(x.double().clone(), last["method"], last["coefficients"], norm=None if last["norm"] is None else last["norm"].double(), normalized=last["normalized"])
    r64 = (rules.frobenius_norms(o64).reshape(-1) / math.sqrt(min(o64.shape[-2:])))
    sv = torch.linalg.svdvals(x.double()[rec["bad"]]) if x.dim() == 3 else None
    entry = dict(file=os.path.basename(path), rec=rec, dtype=str(x.dtype), shape=list(x.shape), replays_bad_matrices=bad_counts, replay_worst_ratio=worst,
                 float64_ratio_bad=[float(r64[i]) for i in rec["bad"]], float64_max=float(r64.max()),
                 input_sv_max_min=[(float(s.max()), float(s.min())) for s in sv] if sv is not None else None,
                 saved_ortho_ratio=[float((rules.frobenius_norms(d["ortho"]).reshape(-1) / math.sqrt(min(d["ortho"].shape[-2:])))[i]) for i in rec["bad"]])
    print(json.dumps(entry), flush=True); report.append(entry)
json.dump(report, open(f"{OUT}/replay.json", "w"), indent=1)
