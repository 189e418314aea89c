import sys, time, json, statistics, cProfile, pstats, io, argparse
import torch
try:
    from dion3.tools.bench.presets import llama
    from dion3.tools.bench.step_time import make_optimizer, make_parameters, parse_variant
except ImportError:
    from dion3.bench.presets import llama
    from dion3.bench.step import make_optimizer, make_parameters, parse_variant
p = argparse.ArgumentParser(); p.add_argument("--tag"); p.add_argument("--out"); p.add_argument("--profile", action="store_true")
p.add_argument("--optimizers", default="muon-gram,normuon,dion3-1/4"); p.add_argument("--shape", default="384")
a = p.parse_args()
shapes = {"384": llama("l384", 12, 384, 128, 1024, vocab=1, tied=True), "110m": llama("l110", 16, 768, 256, 2304, vocab=1, tied=True),
          "1b": llama("l1b", 16, 2048, 512, 8192, vocab=1, tied=True), "8b": llama("l8b", 32, 4096, 1024, 14336, vocab=1, tied=True)}
preset = shapes[a.shape]
dev = torch.device("cuda")
res = {}
for name in a.optimizers.split(","):
    torch.manual_seed(0)
    m, _ = make_parameters(preset, dev, with_scalars=False)
    opt = make_optimizer(parse_variant(name), m, [], dev, graph=False)
    for _ in range(10): opt.step()
    torch.cuda.synchronize()
    dev_ms, host_ms = [], []
    for _ in range(40):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); t = time.perf_counter(); opt.step(); host_ms.append((time.perf_counter() - t) * 1e3); e1.record()
        torch.cuda.synchronize(); dev_ms.append(e0.elapsed_time(e1))
    r = dict(device_ms=statistics.median(dev_ms), host_ms=statistics.median(host_ms))
    if a.profile:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            opt.step(); torch.cuda.synchronize()
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = [e for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")]
        r["gpu_kernels"] = len(kern); r["launch_calls"] = len(launches)
        names = {}
        for e in kern: names[e.name[:60]] = names.get(e.name[:60], 0) + 1
        r["kernels_by_name"] = sorted(names.items(), key=lambda x: -x[1])[:40]
        pr = cProfile.Profile(); pr.enable()
        for _ in range(10): opt.step()
        torch.cuda.synchronize(); pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); r["cprofile_tottime"] = s.getvalue()[-6000:]
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("dion3", 30); r["cprofile_cum"] = s.getvalue()[-6000:]
    res[name] = r
    print(a.tag, a.shape, name, {k: v for k, v in r.items() if k in ("device_ms", "host_ms", "gpu_kernels", "launch_calls")}, flush=True)
    del opt, m; torch.cuda.empty_cache()
if a.out: json.dump(res, open(a.out, "w"), indent=1)
