"""Training curves from a run's metrics.jsonl: OUTPUT_DIR/curves.png. matplotlib is optional; without it, one line
says how to get the plot.

    python plot.py OUTPUT_DIR            # the same as: python train.py --plot OUTPUT_DIR

Four panels by step: the mean reward of each reward function (the evaluations on held-out questions as large
markers), the KL to the reference, the completion length, and the fraction of groups whose rewards were all equal
(zero spread: no learning signal from the rewards).
"""
import json
import os
import sys


def read_metrics(output_dir):
    """The step rows and the evaluation rows of OUTPUT_DIR/metrics.jsonl (a line cut short by a kill is skipped)."""
    steps, evals = [], []
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if any(k.startswith("eval/") for k in row):
                evals.append(row)
            elif "reward" in row:
                steps.append(row)
    return steps, evals


def curves(output_dir):
    """Write OUTPUT_DIR/curves.png and return its path; None (and one line on stdout) without matplotlib or data."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install matplotlib, then python plot.py {output_dir})")
        return None
    if not os.path.isfile(os.path.join(output_dir, "metrics.jsonl")):
        print(f"no plot: there is no {output_dir}/metrics.jsonl")
        return None
    steps, evals = read_metrics(output_dir)
    if not steps and not evals:
        print(f"no plot: {output_dir}/metrics.jsonl has no steps yet")
        return None
    x = [row["step"] for row in steps]
    names = sorted({k[len("rewards/"):] for row in steps + evals for k in row
                    if k.startswith("rewards/") and not k.endswith("_std")})
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    ax = axes[0, 0]
    for i, name in enumerate(names):
        color = f"C{i}"
        ax.plot(x, [row.get(f"rewards/{name}") for row in steps], color=color, lw=1, label=f"{name} (train batch)")
        ex = [row["step"] for row in evals if f"eval/{name}" in row]
        ax.plot(ex, [row[f"eval/{name}"] for row in evals if f"eval/{name}" in row], "o--", color=color, ms=7,
                label=f"{name} (eval)")
    ax.set(title="reward per function", ylabel="mean reward")
    ax.legend(fontsize=7)
    panels = [(axes[0, 1], "kl", "KL(π_θ || π_ref) per token"), (axes[1, 0], "completion_len_mean",
              "completion length (tokens, mean)"), (axes[1, 1], "frac_zero_std", "groups with zero reward spread")]
    for ax, key, title in panels:
        ax.plot(x, [row.get(key) for row in steps], color="C3", lw=1)
        ax.set(title=title)
        for row in evals:
            ax.axvline(row["step"], color="gray", lw=0.6, ls=":")
    axes[1, 1].set_ylim(-0.05, 1.05)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(os.path.basename(os.path.normpath(output_dir)) + " (dotted lines: evaluations)")
    fig.tight_layout()
    path = os.path.join(output_dir, "curves.png")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"curves: {path}")
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python plot.py OUTPUT_DIR")
    curves(sys.argv[1])
