"""What a run reports: its progress line and OUTPUT_DIR/metrics.jsonl (written here, truncated here
on --resume, read back here), with --report-to the same rows and sampled completions in TensorBoard
or W&B (trackers.py, fed here), the closing before/after table, and the training curves drawn from
them, OUTPUT_DIR/curves.png. matplotlib is optional; without it, one line says how to get the plot.

    python trainer.py --plot OUTPUT_DIR  # draws OUTPUT_DIR/curves.png again, from its metrics.jsonl

Four panels by step: the mean reward of each reward function (the evaluations on held-out questions
as large markers), the KL to the reference, the completion length, and the fraction of groups whose
rewards were all equal (zero spread: no learning signal from the rewards).
"""

import collections
import json
import os
import sys

import numpy as np

from support import distributed, trackers
from support.errors import UserError, WriteFailed, failure


def read_rows(path):
    """The rows of a metrics.jsonl, in order. A blank line is skipped, and so is a last line cut
    short by a kill in the middle of a write (with a message). Any other line that is not a JSON
    object with an integer "step" is a UserError naming the file and line: this program never
    writes one, so the file was edited or damaged."""
    with open(path) as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    rows = []
    for i, (number, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError as e:
            if i == len(lines) - 1:
                print(f"metrics.jsonl: skipping a line cut short: {line[:80]!r}", file=sys.stderr)
                continue
            problem = f"is not JSON ({e})"
        else:
            if isinstance(row, dict) and type(row.get("step")) is int:
                rows.append(row)
                continue
            problem = 'is not a JSON object with an integer "step"'
        raise UserError(
            f"{path}:{number} {problem}: {line.strip()[:80]!r}. Every line this program writes is one; the file was "
            "edited or damaged. Delete that line (metrics.jsonl is the run's log; the training is in checkpoint/), "
            "or move the file away to start the log afresh."
        )
    return rows


def read_metrics(output_dir):
    """The step rows and the evaluation rows of OUTPUT_DIR/metrics.jsonl."""
    steps, evals = [], []
    for row in read_rows(os.path.join(output_dir, "metrics.jsonl")):
        if any(k.startswith("eval/") for k in row):
            evals.append(row)
        elif "reward" in row:
            steps.append(row)
    return steps, evals


class MetricsLog:
    """A run's OUTPUT_DIR/metrics.jsonl, and the trackers --report-to started for it (rank 0's;
    none elsewhere): every row written goes to both. The run owns it (train.Run.log) and closes it
    when it ends, however it ends."""

    def __init__(self, path, trackers=None):
        self.path, self.trackers = path, trackers

    def write(self, row):
        write_log(self.path, row)
        if self.trackers is not None:
            self.trackers.log(row)

    def samples(self, step, samples):
        """Sampled completions, for the trackers (metrics.jsonl holds numbers only)."""
        if self.trackers is not None:
            self.trackers.log_samples(step, samples)

    def close(self, failed=False):
        """failed: the run ended on an error, not a stop it was asked for (the trackers say so)."""
        if self.trackers is not None:
            self.trackers.close(failed)
        self.trackers = None


def open_log(output_dir, resumed_at=None, args=None):
    """The run's MetricsLog, and the evaluations already in it. A resumed run keeps the lines up to
    its checkpoint's step (a run that went on past its last checkpoint logged more); a new run
    starts it empty. The kept lines are written beside it and renamed over it, so a full disk
    cannot lose them. Under torchrun every rank reads it, and rank 0 alone writes it. With the
    run's flags (args), the trackers --report-to names start too."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "metrics.jsonl")
    kept = []
    if resumed_at is not None and os.path.isfile(path):
        kept = [row for row in read_rows(path) if row["step"] <= resumed_at]
    distributed.barrier()  # every rank has read it before rank 0 rewrites it
    if distributed.is_main():
        try:
            with open(path + ".tmp", "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in kept)
            os.replace(path + ".tmp", path)
        except OSError as e:
            if os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")
            raise WriteFailed(
                f"could not write {path}: {failure(e)}. It was not changed. Free space (or pass another "
                "--output-dir), then run the same command again."
            ) from None
    evals = [
        (row["step"], {k[5:]: v for k, v in row.items() if k.startswith("eval/")})
        for row in kept
        if any(k.startswith("eval/") for k in row)
    ]
    started = None if args is None else trackers.start(args, output_dir, resumed_at)
    return MetricsLog(path, started), evals


def curves(output_dir):
    """Write OUTPUT_DIR/curves.png from its metrics.jsonl and return its path; None (and one line on
    stdout) without matplotlib or data."""
    if not os.path.isfile(os.path.join(output_dir, "metrics.jsonl")):
        print(f"no plot: there is no {output_dir}/metrics.jsonl")
        return None
    steps, evals = read_metrics(output_dir)
    return draw(output_dir, columns(steps), evals)


def columns(rows):
    """The step rows as columns: {key: [each row's value, None where it has none]}."""
    keys = dict.fromkeys(k for row in rows for k in row)
    return collections.defaultdict(list, {k: [row.get(k) for row in rows] for k in keys})


def draw(output_dir, steps, evals):
    """OUTPUT_DIR/curves.png from the step metrics as columns ({key: [value per step]}, as
    columns() makes them; every key it plots, "step", "rewards/NAME", "kl", "completion_len_mean"
    and "frac_zero_std", in every step) and the evaluation rows ({"step": s, "eval/NAME": v});
    returns its path, or None (and one line on stdout) without matplotlib or data."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"no plot: matplotlib is not installed (pip install matplotlib, then python trainer.py --plot {output_dir})"
        )
        return None
    x = steps.get("step", [])
    if not x and not evals:
        print(f"no plot: {output_dir}/metrics.jsonl has no steps yet")
        return None
    names = sorted(
        k[len("rewards/") :] for k in steps if k.startswith("rewards/") and not k.endswith("_std")
    )
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    ax = axes[0, 0]
    for i, name in enumerate(names):
        color = f"C{i}"
        ax.plot(x, steps[f"rewards/{name}"], color=color, lw=1, label=f"{name} (train batch)")
        ex = [row["step"] for row in evals if f"eval/{name}" in row]
        ax.plot(
            ex,
            [row[f"eval/{name}"] for row in evals if f"eval/{name}" in row],
            "o--",
            color=color,
            ms=7,
            label=f"{name} (eval)",
        )
        # maj@k and pass@k of the same evaluations (DeepSeekMath's Figure 7 pair)
        for prefix, style in ((f"eval/{name}_maj@", "s:"), (f"eval/{name}_pass@", "^:")):
            for key in sorted({k for row in evals for k in row if k.startswith(prefix)}):
                ax.plot(
                    [row["step"] for row in evals if key in row],
                    [row[key] for row in evals if key in row],
                    style,
                    color=color,
                    ms=6,
                    label=f"{key[len('eval/') :]} (eval)",
                )
    ax.set(title="reward per function", ylabel="mean reward")
    ax.legend(fontsize=7)
    panels = [
        (axes[0, 1], "kl", "KL(π_θ || π_ref) per token"),
        (axes[1, 0], "completion_len_mean", "completion length (tokens, mean)"),
        (axes[1, 1], "frac_zero_std", "groups with zero reward spread"),
    ]
    for ax, key, title in panels:
        ax.plot(x, steps.get(key, [None] * len(x)), color="C3", lw=1)
        ax.set(title=title)
        for row in evals:
            ax.axvline(row["step"], color="gray", lw=0.6, ls=":")
    axes[1, 1].set_ylim(-0.05, 1.05)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(os.path.basename(os.path.normpath(output_dir)) + " (dotted lines: evaluations)")
    fig.tight_layout()
    path = os.path.join(output_dir, "curves.png")
    try:
        fig.savefig(path, dpi=80)
    except OSError as e:
        raise WriteFailed(
            f"could not write {path}: {failure(e)}. The run itself is saved; free space, then "
            f"python trainer.py --plot {output_dir} draws it again."
        ) from None
    finally:
        plt.close(fig)
    print(f"curves: {path}")
    return path


# --------------------------------------------------------------------------------------------------
# What a run prints: one line per step on stdout, the same fields as JSON in
# OUTPUT_DIR/metrics.jsonl (docs/logging.md), a sampled completion now and then, the header and the
# closing before/after table.


def step_metrics(
    reward, per_fn, lengths, truncated, group_size, updates, times, steps_left, scheduler
):
    """The step's metrics, from its rewards [N], each function's {name: [N]}, the completion
    lengths and truncation flags [N] (every rank's, under torchrun); those of the updates are
    their mean over the μ iterations (0 when there was none). times: every step's seconds so far
    (this one last), for the ETA."""
    seconds, eta = times[-1], np.mean(times) * steps_left
    # why updates were skipped (non-finite loss or gradient)
    skips = [u["skipped"] for u in updates if u["skipped"]]

    def mean(key):
        return float(np.mean([u[key] for u in updates])) if updates else 0.0

    lengths = lengths.float()
    groups = reward.view(-1, group_size)
    return dict(
        loss=mean("loss"),
        reward=reward.mean().item(),
        reward_std=reward.std().item(),
        **{f"rewards/{n}": r.mean().item() for n, r in per_fn.items()},
        **{f"rewards/{n}_std": r.std().item() for n, r in per_fn.items()},
        **({"accuracy": per_fn["correctness"].mean().item()} if "correctness" in per_fn else {}),
        kl=mean("kl"),
        clip_frac=mean("clip_frac"),
        entropy=mean("entropy"),
        grad_norm=mean("grad_norm"),
        completion_len_mean=lengths.mean().item(),
        completion_len_max=int(lengths.max()),
        frac_zero_std=(groups == groups[:, :1]).all(1).float().mean().item(),
        frac_truncated=truncated.float().mean().item(),
        lr=updates[0]["lr"] if updates else scheduler.get_last_lr()[0],
        step_time=seconds,
        tokens_per_s=lengths.sum().item() / seconds,
        eta_s=float(eta),
        skipped_nonfinite=len(skips),
        **({"skip_reason": skips[0]} if skips else {}),
        **option_metrics(updates),
    )


# What train.policy_update reports of the options that are on (the mismatch: first update only),
# and kl_penalty: --kl-in-reward's mean β Σ_t k1 subtracted from the rewards
# (trainer.reward_with_kl)
OPTION_METRICS = (
    "dppo_dropped",
    "entropy_dropped",
    "off_policy_masked",
    "sampler_truncated",
    "sampler_masked",
    "mismatch_kl",
    "mismatch_max_ratio",
    "truncation_gap",
    "kl_penalty",
)


def option_metrics(updates):
    """Each option metric the updates carry, its mean over those that carry it."""
    return {
        key: float(np.mean([u[key] for u in updates if key in u]))
        for key in OPTION_METRICS
        if any(key in u for u in updates)
    }


# Each completion's tool use: its calls; whether it called (tool_use); its errors (every call that
# returned "error: ..."); of those, its malformed calls (that could not run: an unknown name, bad
# JSON, arguments the tool's schema refuses; tools.Tools.run); and whether it called and every one
# of its calls was well-formed (tool_well_formed; a tool that raised on well-formed arguments, as
# the shop's price of an item it does not sell, still counts as well-formed).
TOOL_COLUMNS = ("tool_calls", "tool_use", "tool_errors", "tool_malformed", "tool_well_formed")


def tool_columns(calls, errors, malformed):
    """{TOOL_COLUMNS name: [N] float} from each completion's calls, errors and malformed calls
    [N]."""
    calls, errors, malformed = calls.float(), errors.float(), malformed.float()
    well_formed = ((calls > 0) & (malformed == 0)).float()
    return dict(zip(TOOL_COLUMNS, (calls, (calls > 0).float(), errors, malformed, well_formed)))


def tool_metrics(calls, errors, malformed):
    """The step's tool use: the means of tool_columns over its completions."""
    return {name: x.mean().item() for name, x in tool_columns(calls, errors, malformed).items()}


def log_step(log, step, steps, beta, m, reward_names):
    """Step `step` (of `steps`) on the progress line and in the log; the KL only when β > 0."""
    per_fn = " ".join(
        f"{n} {m[f'rewards/{n}']:.3f}±{m[f'rewards/{n}_std']:.2f}" for n in reward_names
    )
    kl = f" | kl {m['kl']:.4f}" if beta > 0 else ""
    print(
        f"step {step}/{steps} | loss {m['loss']:+.4f} | reward {m['reward']:.3f}±{m['reward_std']:.2f} | "
        f"{per_fn}{kl} | clip {m['clip_frac']:.3f} | ent {m['entropy']:.2f} | len {m['completion_len_mean']:.0f}/"
        f"{m['completion_len_max']} | zero-std {m['frac_zero_std']:.2f} | lr {m['lr']:.2e} | {m['step_time']:.2f}s | "
        f"{m['tokens_per_s']:.0f} tok/s | eta {format_seconds(m['eta_s'])}"
        + (
            f" | dynamic: {m['dynamic_groups']} groups kept, {m['dynamic_dropped']} dropped, {m['dynamic_calls']} "
            "generate calls"
            if "dynamic_calls" in m
            else ""
        )
        + (
            f" | tools {m['tool_calls']:.2f}/completion, {m['tool_use']:.0%} call, "
            f"{m['tool_errors']:.2f} errors ({m['tool_malformed']:.2f} malformed), "
            f"{m['tool_well_formed']:.0%} well-formed"
            if "tool_calls" in m
            else ""
        )
        + "".join(f" | {k.replace('_', ' ')} {m[k]:.3g}" for k in OPTION_METRICS if k in m)
        + (
            " | SKIPPED the update: no group had reward spread"
            if m.get("skipped_no_spread")
            else ""
        )
        + (
            f" | SKIPPED {m['skipped_nonfinite']} update(s): {m['skip_reason']}"
            if m["skipped_nonfinite"]
            else ""
        ),
        flush=True,
    )
    log.write({"step": step, **m})


def write_log(path, row):
    """Append one row to metrics.jsonl. A write that fails (a full disk) is cut back off the
    file, so no torn line is left, and is a WriteFailed: the run stops without saving, and
    --resume redoes the steps since its checkpoint."""
    line = (json.dumps(row) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start, written = os.lseek(fd, 0, os.SEEK_END), 0
            try:
                # a write may take a part of the line, and fail on the rest
                while written < len(line):
                    written += os.write(fd, line[written:])
            except OSError:
                os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)
    except OSError as e:
        raise WriteFailed(
            f"could not write {path}: {failure(e)}. The run stopped without saving: the last checkpoint in "
            f"{os.path.dirname(path) or '.'} stands. Free space (or move the run elsewhere), then rerun with --resume "
            "(--overwrite if no checkpoint was saved yet)."
        ) from None


def print_header(args, model):
    world = getattr(args, "world_size", 1)
    print(
        f"GRPO: {sum(p.numel() for p in model.parameters()):,} parameters on {args.device} ({args.dtype}); "
        f"{args.steps} steps x {world * args.batch_size * args.gradient_accumulation_steps} prompts x G="
        f"{args.num_generations}, mu={args.num_iterations}, beta={args.beta}"
        + (
            f"; {world} processes, {args.batch_size * args.gradient_accumulation_steps} prompts each"
            if world > 1
            else ""
        )
        + f"; output {args.output_dir}",
        flush=True,
    )


def print_data(task, eval_limit=None):
    """The run's second line: the rows it trains and evaluates on, and where they came from."""
    held_out = len(task.eval[:eval_limit])
    used = f" (the first {held_out} of {len(task.eval)})" if held_out < len(task.eval) else ""
    parts = [f"train {len(task.train)} rows from {task.train_from}"] if task.train else []
    parts += [
        f"held-out {held_out} rows{used} from {task.eval_from}" if task.eval else "no held-out"
    ]
    print("data: " + "; ".join(parts), flush=True)


def format_seconds(s):
    return f"{s / 3600:.1f}h" if s >= 3600 else f"{s / 60:.1f}m" if s >= 60 else f"{s:.0f}s"


def print_eval_progress(done, total, seconds):
    """One line per evaluation batch: questions done (this rank's), time so far and about how
    long is left."""
    left = seconds / done * (total - done) if done else 0.0
    print(
        f"  eval: {done}/{total} questions, {format_seconds(seconds)}, about {format_seconds(left)} left",
        flush=True,
    )


def print_sample(log, every, step, prompt, responses, rewards, answer):
    """Every --sample-every steps, the first completion of a group (responses, with their rewards
    [G]) on stdout; the whole group, with its prompt and reference answer, to the run's trackers
    (--report-to)."""
    if every <= 0 or step % every:
        return
    print(
        f"--- sample at step {step}: reward {float(rewards[0]):.2f}, reference answer {answer}\n"
        f"[prompt, last 300 characters]\n{prompt[-300:]}\n[completion]\n{responses[0]}\n---",
        flush=True,
    )
    if log.trackers is not None:
        answer = answer if isinstance(answer, str) else json.dumps(answer, default=str)
        samples = [
            dict(prompt=prompt, completion=text, reward=float(reward), answer=answer)
            for text, reward in zip(responses, rewards)
        ]
        log.samples(step, samples)


def print_eval_table(evals, count, samples, temperature):
    """The held-out table: each reward's mean (and pass@k) at the first evaluation and at the
    last."""
    (first, before), (last, after) = evals[0], evals[-1]
    print(
        f"\neval on {count} questions x {samples} samples (T={temperature}), step {first} -> {last}"
    )
    width = max(len(name) for name in before) + 2
    print(f"  {'':<{width}}{'before':>8}{'after':>8}{'change':>9}")
    for name in before:
        print(
            f"  {name:<{width}}{before[name]:>8.4f}{after[name]:>8.4f}{after[name] - before[name]:>+9.4f}"
        )
