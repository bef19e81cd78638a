"""DeepSeekMath's Figure 5 in miniature: outcome supervision, process supervision, and process
supervision with the reference reset, on --task chain (docs/results.md has the commands).

    python -m scripts.figure5 DIR [--plot PNG]

DIR holds the runs and evaluations as the commands in docs/results.md write them: ARM-sSEED/ (a
run's output directory: metrics.jsonl), ARM-sSEED.log (its output, last line "wall N s") and
eval-NAME-eEVALSEED.log (`trainer.py --eval-only` output: the "eval on ..." line), NAME being
base or ARM-sSEED. Prints the table (markdown) and, with --plot, draws held-out accuracy per arm
(each seed a dot, the eval noise as a band around the base model) beside each arm's training
correctness per step (mean over seeds).
"""

import argparse
import glob
import json
import os
import re
import statistics

ARMS = ("outcome", "process", "reset")
LABELS = {
    "outcome": "outcome supervision",
    "process": "process supervision",
    "reset": "process + π_ref reset every 10 steps",
}
METRICS = ("correctness", "correctness_maj@8", "correctness_pass@8")


def read_eval(path):
    """{metric: value} from an --eval-only log's "eval on ..." line; {} if it has none."""
    with open(path) as f:
        for line in f:
            if line.startswith("eval on "):
                pairs = re.findall(r"([\w@/.-]+) (-?[0-9.]+)(?:,|$)", line.split(": ", 1)[1])
                return {k: float(v) for k, v in pairs}
    return {}


def evals(root):
    """{name: {eval seed: {metric: value}}} for every eval-NAME-eSEED.log in root."""
    out = {}
    for path in sorted(glob.glob(os.path.join(root, "eval-*-e*.log"))):
        name, seed = re.fullmatch(r"eval-(.+)-e(\d+)\.log", os.path.basename(path)).groups()
        values = read_eval(path)
        if values:
            out.setdefault(name, {})[int(seed)] = values
    return out


def wall(root, run):
    """A run's wall time in seconds from the last line of its log ("wall N s"), else None."""
    try:
        with open(os.path.join(root, f"{run}.log")) as f:
            last = f.read().strip().splitlines()[-1]
    except (OSError, IndexError):
        return None
    match = re.fullmatch(r"wall ([0-9.]+) s", last)
    return float(match[1]) if match else None


def noise(by_seed, metric):
    """The std over eval seeds of one model's metric (None with fewer than 2)."""
    values = [v[metric] for v in by_seed.values() if metric in v]
    return statistics.stdev(values) if len(values) > 1 else None


def table(root):
    e = evals(root)
    lines = [
        "| arm | seed | accuracy | maj@8 | pass@8 | eval noise (std of accuracy, 3 eval seeds) | wall |",
        "|---|---|---|---|---|---|---|",
    ]
    if "base" in e:
        b, n = e["base"][0], noise(e["base"], "correctness")
        lines.append(
            f"| before training | | {b['correctness']:.4f} | {b['correctness_maj@8']:.4f} | "
            f"{b['correctness_pass@8']:.4f} | {'' if n is None else f'{n:.4f}'} | |"
        )
    for arm in ARMS:
        for seed in (0, 1):
            run = f"{arm}-s{seed}"
            if run not in e or 0 not in e[run]:
                continue
            v, n, w = e[run][0], noise(e[run], "correctness"), wall(root, run)
            lines.append(
                f"| {LABELS[arm]} | {seed} | {v['correctness']:.4f} | {v['correctness_maj@8']:.4f} | "
                f"{v['correctness_pass@8']:.4f} | {'' if n is None else f'{n:.4f}'} | "
                f"{'' if w is None else f'{w / 60:.1f} min'} |"
            )
    return "\n".join(lines)


def training_curve(root, run):
    """The training correctness of each step (the outcome arm logs it as last-number)."""
    with open(os.path.join(root, run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    key = "rewards/correctness"
    return [r.get(key, r.get("rewards/last-number")) for r in rows if "reward" in r]


def plot(root, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = evals(root)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    if "base" in e:
        base = e["base"][0]["correctness"]
        n = noise(e["base"], "correctness") or 0.0
        left.axhspan(base - n, base + n, color="0.85")
        left.axhline(base, color="0.4", lw=1, label="before training (± eval noise)")
    for x, arm in enumerate(ARMS):
        values = [e[f"{arm}-s{s}"][0]["correctness"] for s in (0, 1) if f"{arm}-s{s}" in e]
        left.scatter([x] * len(values), values, color=f"C{x}", zorder=3)
        if values:
            left.hlines(statistics.mean(values), x - 0.2, x + 0.2, color=f"C{x}")
        curves = [
            training_curve(root, f"{arm}-s{s}")
            for s in (0, 1)
            if os.path.exists(os.path.join(root, f"{arm}-s{s}", "metrics.jsonl"))
        ]
        if curves:
            steps = min(len(c) for c in curves)
            mean = [statistics.mean(c[i] for c in curves) for i in range(steps)]
            smooth = [statistics.mean(mean[max(0, i - 4) : i + 1]) for i in range(steps)]
            right.plot(range(1, steps + 1), smooth, color=f"C{x}", label=LABELS[arm])
    left.set_xticks(range(len(ARMS)), [LABELS[a].replace(" + ", "\n+ ") for a in ARMS], fontsize=8)
    left.set_ylabel("held-out accuracy (100 questions x 8, T = 0.7)")
    left.legend(fontsize=8)
    right.set_xlabel("step")
    right.set_ylabel("training correctness (mean of seeds, 5-step mean)")
    right.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, --task chain, 40 steps of 4 questions x G = 8")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    print(table(args.dir))
    if args.plot:
        plot(args.dir, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
