"""Each whole inverse period's mean step (step timer, timings.jsonl) of every run of this sitting."""
import glob, json, sys
root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/bound2"
I = {"1_10": 10, "10_100": 100}
for f in sorted(glob.glob(f"{root}/*/run/*/timings.jsonl") + glob.glob(f"{root}/bench_*/runs/*/run/*/timings.jsonl")):
    name = f[len(root) + 1:].split("/")[0]
    every = next(v for k, v in I.items() if k in name)
    steps = {l["step"]: l["total"] for l in map(json.loads, open(f))}
    periods = []
    start = every + 1  # the first period after the warm-up one (steps 1..I)
    while all(s in steps for s in range(start, start + every)):
        periods.append(sum(steps[s] for s in range(start, start + every)) / every)
        start += every
    print(f"{name:24s} periods from step {every + 1}: " + " ".join(f"{p:.3f}" for p in periods))
