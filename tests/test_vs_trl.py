"""scripts/vs_trl_learning.py, the harness that compares our loop's learning with TRL's
GRPOTrainer (issue 46): TRL's side is fed, step by step, the prompts our loop draws; its settings
are the flags' meaning; the table and plot from evaluation logs. TRL itself runs only where
BENCH_PYTHON names a Python that has it (the benchmark's environment): that test skips otherwise."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import config
import data
import trainer
from helpers import CPU, ROOT, tiny_model_dir
from scripts import vs_trl_learning as vs

ADDITION = ["--model", "M", "--task", "addition"]


def parsed(*flags):
    return config.parse_args([*ADDITION, *CPU, "--output-dir", "unused", *flags])


# --- what TRL is fed: our loop's prompts, step by step


@pytest.mark.parametrize("seed", [1, 2])
def test_trl_sampler_over_the_ordered_dataset_gives_each_step_our_loops_prompts(seed):
    # The comparison's run: 40 steps of 4 prompts x G = 8. TRL reads the dataset in order
    # (shuffle_dataset=False): RepeatSampler's batches of 4, each index 8 times in a row.
    args = parsed("--seed", str(seed))
    task, per_step, G = data.addition_task(), vs.prompts_per_step(args), args.num_generations
    assert (args.steps, per_step, G) == (40, 4, 8)
    steps = vs.step_rows(task.train, per_step, seed, args.steps)
    fed = [row for batch in steps for row in batch]  # the dataset trl_worker builds
    batches = vs.repeat_sampler_steps(len(fed), per_step, G, args.steps)
    assert len(batches) == args.steps
    for step, indices in enumerate(batches):
        ours = data.batch_at(task.train, per_step, seed, step)
        assert [fed[i] for i in indices] == [row for row in ours for _ in range(G)]


def test_the_two_seeds_train_on_different_prompts_and_no_held_out_question():
    task = data.addition_task()
    one, two = (vs.step_rows(task.train, 4, seed, 40) for seed in (1, 2))
    assert one != two
    held_out = {row["prompt"] for row in task.eval}
    assert not held_out & {row["prompt"] for batch in one + two for row in batch}


@pytest.mark.slow
def test_our_trainer_draws_the_prompts_the_trl_side_is_fed(tmp_path):
    # trainer.train itself, 3 steps on the tiny model: the rows it scores at each step are the
    # per-step rows trl_worker's dataset holds, in the same order (each repeated G times).
    seen = []

    @dataclasses.dataclass
    class Seen(data.Task):
        def score(self, rows, completions, G=1, lengths=None, tool_calls=None, steps=None):
            seen.append([row["prompt"] for row in rows])
            return super().score(rows, completions, G, lengths, tool_calls, steps)

    argv = ["--model", tiny_model_dir(tmp_path), "--task", "addition", *CPU, "--seed", "2"]
    argv += ["--steps", "3", "--max-new-tokens", "2", "--eval-every", "-1", "--sample-every", "0"]
    args = config.parse_args([*argv, "--output-dir", str(tmp_path / "run")])
    task, model, tokenizer = trainer.setup(args)
    fields = {f.name: getattr(task, f.name) for f in dataclasses.fields(task)}
    trainer.train(args, Seen(**fields), model, tokenizer)
    fed = vs.step_rows(task.train, vs.prompts_per_step(args), args.seed, args.steps)
    assert seen == [[row["prompt"] for row in batch] for batch in fed]


# --- TRL's settings: each flag's meaning


def test_trl_config_is_the_addition_runs_settings_with_ours_where_trl_defaults_differ():
    kw = vs.trl_config_kwargs(parsed("--seed", "1"), "OUT")
    assert kw["per_device_train_batch_size"] == 32  # TRL counts completions: 4 prompts x 8
    assert (kw["gradient_accumulation_steps"], kw["num_generations"], kw["num_iterations"]) == (
        1,
        8,
        1,
    )
    assert (kw["max_completion_length"], kw["temperature"], kw["top_p"], kw["top_k"]) == (
        48,
        0.7,
        1.0,
        0,
    )
    assert (kw["learning_rate"], kw["lr_scheduler_type"], kw["warmup_steps"]) == (
        2e-5,
        "constant",
        0,
    )
    assert (kw["beta"], kw["epsilon"], kw["epsilon_high"]) == (0.04, 0.2, None)
    # ours, the paper's, where TRL 1.16's defaults differ (docs/trl.md)
    assert (kw["loss_type"], kw["scale_rewards"], kw["use_bias_correction_kl"]) == (
        "grpo",
        "group",
        False,
    )
    assert kw["disable_dropout"] and not kw["gradient_checkpointing"]
    assert (kw["bf16"], kw["fp16"], kw["use_cpu"]) == (False, False, True)  # CPU: fp32, as ours
    assert (kw["weight_decay"], kw["max_grad_norm"], kw["optim"]) == (0.0, 1.0, "adamw_torch_fused")
    assert (kw["adam_beta1"], kw["adam_beta2"], kw["adam_epsilon"]) == (0.9, 0.999, 1e-8)
    assert (kw["max_steps"], kw["seed"], kw["shuffle_dataset"]) == (40, 1, False)


def test_a_flag_given_reaches_trl_as_what_it_means():
    kw = vs.trl_config_kwargs(
        parsed("--loss-type", "dapo", "--kl-bias-correction", "--lr", "1e-6", "--batch-size", "2"),
        "OUT",
    )
    assert (kw["loss_type"], kw["use_bias_correction_kl"], kw["learning_rate"]) == (
        "dapo",
        True,
        1e-6,
    )
    assert kw["per_device_train_batch_size"] == 16


@pytest.mark.parametrize(
    "flags",
    [
        ["--dynamic-sampling"],
        ["--num-iterations", "2"],
        ["--surrogate", "cispo"],
        ["--lora-rank", "4"],
    ],
)
def test_a_flag_without_a_trl_counterpart_is_refused_before_anything_runs(flags, capsys):
    with pytest.raises(SystemExit) as info:
        vs.main(["train-trl", "--root", "unused", "--model", "M", "--seed", "1", "--", *flags])
    assert "no TRL counterpart mapped for --" + flags[0][2:] in str(info.value)


def test_save_points_are_every_n_steps_and_the_last():
    assert vs.save_points(40, 20) == [20, 40]
    assert vs.save_points(2, 1) == [1, 2]
    assert vs.save_points(45, 20) == [20, 40, 45]
    assert vs.save_points(40, 0) == [40]


# --- the table and the plot, from evaluation logs


def synthetic_root(root):
    """Two runs per trainer (seeds 1, 2) saved at 20 and 40, their logs, and evals.jsonl: the base
    model and each checkpoint under eval seeds 0, 1, 2, accuracy = a level per model + a
    per-eval-seed offset of -0.01, 0, +0.01 (std 0.01)."""
    levels = {("ours", 1): (0.40, 0.60), ("ours", 2): (0.50, 0.70), ("trl", 1): (0.30, 0.55)}
    levels[("trl", 2)] = (0.34, 0.65)
    evals = []
    for eval_seed, offset in zip((0, 1, 2), (-0.01, 0.0, 0.01)):
        evals.append(dict(trainer="base", seed=None, step=0, eval_seed=eval_seed))
        evals[-1].update({"correctness": 0.12 + offset, "correctness_pass@8": 0.5})
        for (t, seed), (at20, at40) in levels.items():
            for step, level in ((20, at20), (40, at40)):
                evals.append(dict(trainer=t, seed=seed, step=step, eval_seed=eval_seed))
                evals[-1].update({"correctness": level + offset, "correctness_pass@8": 0.9})
    os.makedirs(root)
    with open(os.path.join(root, "evals.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in evals)
    for t, seed in levels:
        out = os.path.join(root, f"{t}-s{seed}")
        log = os.path.join(out, "run", "metrics.jsonl") if t == "ours" else f"{out}/metrics.jsonl"
        os.makedirs(os.path.dirname(log), exist_ok=True)
        keys = ("reward", "kl", "completion_len_mean" if t == "ours" else "completions/mean_length")
        with open(log, "w") as f:
            f.writelines(
                json.dumps({"step": s, **dict(zip(keys, (s / 40, s / 400, 40 - s / 2)))}) + "\n"
                for s in range(1, 41)
            )
        run = dict(trainer=t, seed=seed, wall_s=900.0 + seed, cpu_s=1700.0, steps_s=840.0)
        run.update(load_before=[2.0, 2.1, 2.2], load_after=[2.5, 2.2, 2.2], threads=2)
        run.update(load_during_mean_1min=2.4, load_during_max_1min=3.1, checkpoints={})
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump(run, f)


def test_summary_means_over_eval_seeds_then_training_seeds_with_the_eval_noise(tmp_path):
    synthetic_root(tmp_path / "r")
    evals = vs.read_jsonl(tmp_path / "r" / "evals.jsonl")
    s = vs.summarize(evals, "correctness")
    assert sorted(s) == ["ours", "trl"] and sorted(s["ours"]) == [0, 20, 40]
    at40 = s["ours"][40]
    assert at40["seeds"][1][0] == pytest.approx(0.60) and at40["seeds"][2][0] == pytest.approx(0.70)
    assert at40["seeds"][1][1] == pytest.approx(0.01)  # std over eval seeds -0.01, 0, +0.01
    assert (at40["mean"], at40["low"], at40["high"]) == pytest.approx((0.65, 0.60, 0.70))
    assert at40["noise"] == pytest.approx(0.01)
    assert s["trl"][0]["mean"] == pytest.approx(0.12)  # the base model: every trainer's step 0
    assert s["trl"][20]["mean"] == pytest.approx(0.32)


def test_report_writes_the_table_and_the_plot(tmp_path, capsys):
    root = tmp_path / "r"
    synthetic_root(root)
    vs.main(["report", "--root", str(root)])
    table = (root / "table.md").read_text()
    assert table == capsys.readouterr().out.split("wrote ")[0].rstrip("\n") + "\n"
    lines = table.splitlines()
    assert "| mean accuracy (pass@1) | step 0 | step 20 | step 40 |" in lines
    assert (
        "| **ours (trainer.py), mean over seeds** (range) | **0.1200** (0.1200–0.1200) | "
        "**0.4500** (0.4000–0.5000) | **0.6500** (0.6000–0.7000) |"
    ) in lines
    assert (
        "| TRL GRPOTrainer, seed 2 | 0.1200 ± 0.0100 | 0.3400 ± 0.0100 | 0.6500 ± 0.0100 |" in lines
    )
    assert "| ours − TRL (means over seeds) | 0.0000 | 0.1300 | 0.0500 |" in lines
    assert "| eval noise: std over eval seeds (pooled) | 0.0100 | 0.0100 | 0.0100 |" in lines
    assert "| pass@8 | step 0 | step 20 | step 40 |" in lines
    assert any(
        line.startswith("| ours (trainer.py), seed 1 | 15 min 1 s | 14 min 0 s |") for line in lines
    )
    assert "2.00 / 2.10 / 2.20 | 2.40, 3.10 | 2.50 / 2.20 / 2.20 |" in table
    pytest.importorskip("matplotlib")
    assert (root / "accuracy.png").stat().st_size > 10_000


def test_training_curves_read_both_logs_under_one_name(tmp_path):
    synthetic_root(tmp_path / "r")
    curves = vs.training_curves(str(tmp_path / "r"))
    assert sorted(curves) == ["ours", "trl"] and sorted(curves["trl"]) == [1, 2]
    length = "completion length (tokens)"
    assert curves["ours"][1][length][:2] == curves["trl"][2][length][:2] == [(1, 39.5), (2, 39.0)]


# --- TRL's side, end to end (needs the benchmark's environment)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("BENCH_PYTHON"),
    reason="TRL runs only under BENCH_PYTHON (e.g. BENCH_PYTHON=benchvenv/bin/python)",
)
def test_trl_side_trains_two_steps_on_our_prompts_and_saves_models_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    model, root = tiny_model_dir(tmp_path), tmp_path / "root"
    cmd = [sys.executable, "-m", "scripts.vs_trl_learning", "train-trl", "--root", str(root)]
    cmd += ["--model", model, "--seed", "1", "--steps", "2", "--save-every", "1", "--threads", "1"]
    cmd += ["--", "--max-new-tokens", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = root / "trl-s1"
    run = json.loads((out / "run.json").read_text())
    assert run["checkpoints"] == {"1": "checkpoint-1", "2": "checkpoint-2"}
    assert run["wall_s"] > 0 and len(run["load_before"]) == 3
    built = json.loads((out / "trl.json").read_text())
    assert built["prompts_checked"] == 2 and built["eos_token_ids"] == built["eos_token_ids_ours"]
    assert built["optimizer"]["groups"] == [
        dict(lr=2e-5, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, amsgrad=False, fused=True)
    ]
    assert (built["policy_dtype"], built["reference_dtype"]) == ("torch.float32",) * 2
    task = data.addition_task()
    want = [[r["prompt"] for r in data.batch_at(task.train, 4, 1, step)] for step in (0, 1)]
    seen = [json.loads(line)["questions"] for line in (out / "prompts_seen.jsonl").open()]
    assert seen == want
    for step in (1, 2):
        AutoModelForCausalLM.from_pretrained(out / f"checkpoint-{step}")


# --- GDPO against TRL's own normalize_then_sum (issue 56, item 4)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("BENCH_PYTHON") and importlib.util.find_spec("trl") is None,
    reason="TRL runs only under BENCH_PYTHON (e.g. BENCH_PYTHON=benchvenv/bin/python), or where "
    "this Python imports trl",
)
def test_gdpo_advantages_are_trls_normalize_then_sum_run_by_its_own_trainer():
    # scripts/bench.py's GDPO rows, in the bench env (bench --parity prints them too): TRL's
    # GRPOTrainer._generate_and_score_completions with multi_objective_aggregation=
    # "normalize_then_sum" on six reward tables (1 to 3 functions' worth of scales and weights, a
    # reward all equal in a group, a negative weight, 8 groups of 8), against grpo.gdpo_advantages.
    # TRL computes in float32, ours in float64: measured 4.6e-8 to 4.8e-7 (trl 1.16.0,
    # 2026-11-27); asked 1e-5 of max(1, |Â|), PARITY_TOL's bound (bench.GDPO_TOL's comment).
    python = os.environ.get("BENCH_PYTHON", sys.executable)
    cmd = [python, "-m", "scripts.bench", "--worker", "gdpo", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    rows = json.loads(line[len("RESULT ") :])["rows"]
    assert len(rows) == 6 and [r["case"] for r in rows if not r["ok"]] == []
    assert max(r["diff"] for r in rows) < 1e-5  # every |Â| here is below 3: the bound is 1e-5
    assert min(r["apart"] for r in rows) > 0.5  # GDPO is not eq. 3's advantage on any table
