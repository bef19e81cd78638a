"""Data parallel on the CPU: DDP and FSDP2 gradients over 2 gloo ranks equal the one-process
gradient (fp32, summed in another order: ~1e-8, asked 1e-6), and trainer.py under torchrun (the
demo, FSDP2, exact resume, FSDP2's sharded AdamW saved with DCP and resumed exactly after a SIGTERM
or a SIGKILL inside a save). No rank sees a GPU.
"""

import copy
import os
import shutil
import signal
import subprocess
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, get_scheduler

import grpo
import sampling
import trainer
from helpers import (
    NO_GPU,
    ROOT,
    assert_same_run,
    read_metrics,
    tiny_rollouts,
    torchrun,
    torchrun_command,
    torchrun_env,
    wait_for,
)
from support import checkpoint, demo, distributed
from support.errors import SaveFailed, UserError

# Group 0 long, group 1 one token each: a per-rank normalizer would be wrong, and under FSDP2 rank
# 1's micro-batch of 1-token completions must still run the same forwards as rank 0's.
DISTRIBUTED_LENGTHS = [6, 5, 6, 4, 1, 1, 1, 1]


def one_update_gradients(rollouts, advantages, loss_type, ddp=None, fsdp=False):
    """The gradient of one policy_update (β = 0.04, μ = 1) of the demo's tiny model (seed 0) on
    these rollouts, with an optimizer that changes nothing (lr 0, no clipping): {name: grad}
    (FSDP2's shards gathered whole), as the optimizer step sees it (policy_update frees the
    gradients right after)."""
    model, _ = demo.model_and_tokenizer(seed=0)
    ddp = ddp(model) if ddp is not None else None
    if fsdp:
        distributed.shard_model(model)
    optimizer, grads = torch.optim.SGD(model.parameters(), lr=0.0), {}
    optimizer.register_step_pre_hook(
        lambda *_: grads.update(
            {
                name: (p.grad.full_tensor() if fsdp else p.grad).clone()
                for name, p in model.named_parameters()
            }
        )
    )
    ref = torch.full(rollouts.completion_mask.shape, -2.0)
    trainer.policy_update(
        model,
        optimizer,
        get_scheduler("constant", optimizer),
        rollouts,
        advantages,
        None,
        ref,
        objective=trainer.LossSettings(0.2, None, 0.04, loss_type, "token", 6, None),
        micro_batch_size=4,
        max_grad_norm=float("inf"),
        ddp=ddp,
    )
    assert grads, "the optimizer never stepped"
    return grads


def distributed_batch(process=False):
    """The rollouts and their advantages: outcome ones [8], or (process) per-token ones [8, 6]
    from step rewards ending at various tokens (DeepSeekMath §4.1.3)."""
    mask = torch.tensor([[1] * n + [0] * (6 - n) for n in DISTRIBUTED_LENGTHS])
    if process:
        steps = [[(1, 1.0), (4, 0.0)], [(2, 1.0)], [(0, 0.0), (5, 1.0)], [], [(0, 1.0)], [(0, 0.0)]]
        steps += [[(0, 1.0), (3, 1.0)], [(2, 0.0)]]
        ends = [[end for end, _ in s] for s in steps]
        rewards = [[r for _, r in s] for s in steps]
        return tiny_rollouts(mask), grpo.process_advantages(rewards, ends, 4, 6)
    return tiny_rollouts(mask), grpo.group_advantages(torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0]), 4)


def distributed_gradient_worker(rank, world, init_file, out_dir):
    """One rank of the equality test: its own group of the batch, gradients all-reduced by DDP."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rollouts, advantages = distributed_batch()
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        mine = (
            sampling.select_groups(rollouts, [rank]),
            advantages[4 * rank : 4 * rank + 4],
            loss_type,
        )
        torch.save(
            one_update_gradients(*mine, ddp=lambda m: distributed.wrap(m, sampling.token_logprobs)),
            f"{out_dir}/{loss_type}-rank{rank}.pt",
        )
        torch.save(
            one_update_gradients(*mine, fsdp=True), f"{out_dir}/{loss_type}-fsdp-rank{rank}.pt"
        )
    # process supervision: per-token advantages travel with their rows
    rollouts, advantages = distributed_batch(process=True)
    mine = (sampling.select_groups(rollouts, [rank]), advantages[4 * rank : 4 * rank + 4], "grpo")
    torch.save(
        one_update_gradients(*mine, ddp=lambda m: distributed.wrap(m, sampling.token_logprobs)),
        f"{out_dir}/process-rank{rank}.pt",
    )
    # both ranks done before either tears gloo down (CI saw rank 1 abort once at exit: "terminate
    # called without an active exception", a C++ thread of the group still running)
    dist.barrier()
    dist.destroy_process_group()


# --- DDP and FSDP2 gradients equal the one-process gradient
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_distributed_gradient_of_2_ranks_x_1_prompt_equals_1_rank_x_2_prompts(
    tmp_path, monkeypatch
):
    # DDP and FSDP2 alike, and per-token advantages (process supervision) under DDP. fp32 on both
    # sides; the sums differ in order only (and the average of world x loss over ranks): ~1e-8,
    # asked 1e-6. The spawned ranks see no GPU (NO_GPU): CPU tensors and gloo only. This process's
    # environment changes for the spawn alone (a CUDA device count first read under it would stay
    # 0 for the session).
    with monkeypatch.context() as m:
        for name, value in NO_GPU.items():
            m.setenv(name, value)
        torch.multiprocessing.spawn(
            distributed_gradient_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2
        )
    rollouts, advantages = distributed_batch()
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        expected = one_update_gradients(rollouts, advantages, loss_type)  # one process, both groups
        for run in (
            f"{loss_type}-rank0",
            f"{loss_type}-rank1",
            f"{loss_type}-fsdp-rank0",
            f"{loss_type}-fsdp-rank1",
        ):
            got = torch.load(tmp_path / f"{run}.pt")
            for name, grad in expected.items():
                torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=f"{run}: {name}")
        assert max(g.abs().max() for g in expected.values()) > 1e-3  # a real gradient, not zeros
    expected = one_update_gradients(*distributed_batch(process=True), "grpo")
    for run in ("process-rank0", "process-rank1"):
        got = torch.load(tmp_path / f"{run}.pt")
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-6, msg=f"{run}: {name}")
    assert max(g.abs().max() for g in expected.values()) > 1e-3


# --- torchrun: the demo, FSDP2, resume
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_distributed_demo_under_torchrun_writes_one_log_and_one_checkpoint_and_learns(tmp_path):
    # 50 steps: correctness rose by +0.23, +0.33, +0.47 for seeds 42, 1, 2 (measured 2026-11-23); at
    # 30 steps the gain still ranged from +0.05 to +0.34 over seeds, too early for a threshold that
    # holds under any sampler.
    out = torchrun(tmp_path / "run", "--steps", "50", "--eval-every", "0")
    assert "2 processes" in out and out.count("step 50/50") == 1  # rank 0 alone prints
    rows = read_metrics(tmp_path / "run")
    # eval, 50 steps, eval: written once
    assert [r["step"] for r in rows] == [0] + list(range(1, 51)) + [50]
    assert (
        {"checkpoint", "metrics.jsonl"}
        <= set(os.listdir(tmp_path / "run"))
        <= {"checkpoint", "metrics.jsonl", "curves.png"}
    )
    state = checkpoint.load_state(str(tmp_path / "run" / "checkpoint"))
    assert state["step"] == 50 and len(state["rngs"]) == 2 and state["args"]["world_size"] == 2
    before, after = rows[0]["eval/correctness"], rows[-1]["eval/correctness"]
    assert after - before >= 0.10, (before, after)


@pytest.mark.slow
def test_distributed_fsdp_demo_runs_5_steps_under_gloo_and_saves_whole_weights(tmp_path):
    # 4 and 3 questions per rank: rank 1 joins a generate call it drops
    out = torchrun(
        tmp_path / "run",
        *"--fsdp --steps 5 --eval-every 5 --eval-limit 7 --eval-batch-size 2".split(),
    )
    assert out.count("step 5/5") == 1 and "eval @ step 5" in out
    saved = AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "checkpoint"
    ).state_dict()  # whole, HF format
    initial, _ = demo.model_and_tokenizer(seed=42)
    assert {k: v.shape for k, v in saved.items()} == {
        k: v.shape for k, v in initial.state_dict().items()
    }
    assert all(torch.isfinite(v).all() for v in saved.values())


@pytest.mark.slow
def test_distributed_resume_under_torchrun_is_exact(tmp_path):
    argv = ["--steps", "3", "--eval-every", "-1", "--save-every", "1", "--lr-scheduler", "constant"]
    torchrun(tmp_path / "straight", *argv)
    torchrun(tmp_path / "resumed", *argv, "--steps", "1")
    torchrun(tmp_path / "resumed", *argv, "--resume")
    assert_same_run(tmp_path / "straight", tmp_path / "resumed")


def torchrun_stopped(out_dir, argv, send):
    """trainer.py under torchrun (2 ranks), stopped by `send(process)` once 3 steps are logged.
    Returns its output."""
    proc = subprocess.Popen(
        torchrun_command(out_dir, *argv),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=torchrun_env(),
        start_new_session=True,  # its own process group, as a terminal's job or a scheduler's job step
    )
    log = os.path.join(out_dir, "metrics.jsonl")
    wait_for(
        lambda: os.path.exists(log) and len(open(log).readlines()) >= 3,
        proc,
        "3 steps were logged",
    )
    send(proc)
    return proc.communicate(timeout=300)[0]


@pytest.mark.slow
def test_distributed_ctrl_c_and_sigterm_under_torchrun_stop_every_rank_at_one_step_and_resume_exactly(
    tmp_path,
):
    """Ctrl-C in a terminal reaches every process of torchrun's group (SIGINT), and torchrun
    forwards it to each worker right after: one request, not the "second signal" that stops at
    once without saving. A scheduler's SIGTERM to torchrun alone is forwarded the same way.
    Either way every rank finishes the same step, they save it together, and --resume continues
    to the weights and metrics of a run never stopped."""
    argv = ["--steps", "8", "--eval-every", "-1", "--save-every", "0", "--lr-scheduler", "constant"]
    argv += "--demo-warmup-steps 0 --reward-fn helpers:varied_reward --num-iterations 2".split()
    torchrun(tmp_path / "straight", *argv)
    for name, send in [
        ("ctrl-c", lambda proc: os.killpg(proc.pid, signal.SIGINT)),
        ("sigterm", lambda proc: proc.send_signal(signal.SIGTERM)),
    ]:
        out = torchrun_stopped(tmp_path / name, argv, send)
        logged = len(read_metrics(tmp_path / name))
        assert 3 <= logged < 8, out[-3000:]
        # the step every rank finished is saved, once
        assert out.count(f"saved {tmp_path / name / 'checkpoint'} (step {logged})") == 1, out[
            -3000:
        ]
        assert checkpoint.load_state(str(tmp_path / name / "checkpoint"))["step"] == logged
        torchrun(tmp_path / name, *argv, "--resume")
        assert_same_run(tmp_path / "straight", tmp_path / name)


@pytest.mark.slow
def test_distributed_a_reward_error_on_one_rank_stops_every_rank_and_they_save_together(tmp_path):
    """Rank 1's reward function raises in step 3. Before, rank 1 exited alone, rank 0 waited in
    the next collective until torchrun killed it, and steps since the last checkpoint were lost.
    Now both ranks stop after scoring, save step 3's start together (steps 1-2 done), and the
    message names the function."""
    (tmp_path / "rank_rewards.py").write_text(
        "import os\n"
        "calls = []\n"
        "def fails_on_rank_1(completions, answers):\n"
        "    calls.append(1)\n"
        "    if os.environ['RANK'] == '1' and len(calls) == 3:\n"
        "        raise ValueError('rank 1 broke')\n"
        "    return [float(len(c) % 5) for c in completions]\n"
    )
    argv = ["--steps", "5", "--eval-every", "-1", "--save-every", "0", "--demo-warmup-steps", "0"]
    argv += ["--reward-fn", "rank_rewards:fails_on_rank_1"]
    env = dict(torchrun_env(), PYTHONPATH=str(tmp_path))
    result = subprocess.run(
        torchrun_command(tmp_path / "run", *argv),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert (
        result.returncode != 0
        and "reward function 'fails_on_rank_1' raised ValueError: rank 1 broke" in out
    )
    assert out.count(f"saved {tmp_path / 'run' / 'checkpoint'} (step 2)") == 1, out[-3000:]
    assert checkpoint.load_state(str(tmp_path / "run" / "checkpoint"))["step"] == 2
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


# --- FSDP2: --resume from the sharded AdamW state (torch.distributed.checkpoint)
# --------------------------------------------------------------------------------------------------


def adamw_after_updates(model, updates):
    """trainer.py's AdamW (fused, weight decay) on `model` after `updates` updates of a fixed
    loss."""
    optimizer = trainer.build_optimizer(model, 1e-2, 0.1)
    for _ in range(updates):
        model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer


def same_state(a, b):
    """Whether two (nested) state dicts are equal, tensors bit for bit."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: DCP says so
def test_fsdp_checkpoint_keeps_adamw_beside_the_hf_weights_and_restores_it_exactly(tmp_path):
    """save_sharded writes AdamW's state with DCP into checkpoint.tmp/optimizer (clearing a killed
    save's leftovers), save completes and swaps it in atomically, from_pretrained still loads the
    checkpoint, and restore_sharded gives back AdamW bit for bit with the weights untouched: before
    the first update (no state: saving must not make one, nor loading), and after two."""
    out, (model, tokenizer) = str(tmp_path), demo.model_and_tokenizer(seed=0)
    os.makedirs(tmp_path / "checkpoint.tmp" / "optimizer")
    (tmp_path / "checkpoint.tmp" / "optimizer" / "__0_0.distcp").write_text("a killed save's")
    state = {"step": 0, "sharded_optimizer": checkpoint.SHARDED}
    for updates in (0, 2):
        optimizer = adamw_after_updates(model, updates)
        saved = copy.deepcopy(optimizer.state_dict())
        run = SimpleNamespace(model=model, optimizer=optimizer)
        checkpoint.save_sharded(run, out)
        assert same_state(optimizer.state_dict(), saved)  # saving made no state, changed none
        path = checkpoint.save(out, model, tokenizer, dict(state, step=updates), sharded=True)
        assert sorted(os.listdir(out)) == ["checkpoint"] and checkpoint.verify(path) is None
        assert sorted(os.listdir(os.path.join(path, "optimizer"))) == [".metadata", "__0_0.distcp"]
        loaded = AutoModelForCausalLM.from_pretrained(path).state_dict()  # the HF format stays
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.items())
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        fresh = trainer.build_optimizer(model, 1e-2, 0.1)
        checkpoint.restore_sharded(path, checkpoint.load_state(path), model, fresh)
        assert same_state(fresh.state_dict(), optimizer.state_dict())
        assert len(fresh.state) == (0 if updates == 0 else len(list(model.parameters())))
        assert same_state(model.state_dict(), weights) and all(
            p.grad is None for p in model.parameters()
        )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp_checkpoint_with_its_adamw_state_cut_short_or_missing_is_not_resumed(tmp_path, capsys):
    """verify reads the DCP directory's .metadata and checks each file it names is whole (no tensor
    read): a cut .distcp or a missing .metadata makes the checkpoint damaged, and find_last falls
    back to a whole checkpoint.old. A checkpoint of an --fsdp run saved without AdamW's state
    (before it was kept) is one paragraph, not a silent fresh AdamW."""
    out, (model, tokenizer) = str(tmp_path), demo.model_and_tokenizer(seed=0)
    run = SimpleNamespace(model=model, optimizer=adamw_after_updates(model, 1))
    checkpoint.save_sharded(run, out)
    path = checkpoint.save(out, model, tokenizer, {"step": 1}, sharded=True)
    shutil.copytree(path, path + ".old")
    shard = os.path.join(path, "optimizer", "__0_0.distcp")
    size = os.path.getsize(shard)
    os.truncate(shard, size - 1)
    assert checkpoint.verify(path) == (
        f"optimizer/__0_0.distcp is cut short ({size - 1:,} bytes; .metadata says {size:,})"
    )
    capsys.readouterr()
    assert checkpoint.find_last(out) == path + ".old"
    assert f"{path} is damaged: optimizer/__0_0.distcp is cut short" in capsys.readouterr().err
    os.remove(os.path.join(path, "optimizer", ".metadata"))
    assert checkpoint.verify(path) == "optimizer/.metadata is missing (the save did not finish)"
    shutil.rmtree(os.path.join(path, "optimizer"))  # as an --fsdp checkpoint saved before
    with pytest.raises(UserError, match="not its sharded AdamW state"):
        checkpoint.restore_sharded(path, {"step": 1}, model, trainer.build_optimizer(model, 1, 0))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_fsdp_adamw_shards_that_do_not_fit_the_disk_are_a_save_failed_and_replace_nothing(
    tmp_path,
):
    """A write of AdamW's shards that fails (a file size limit, as a full disk fails it) is DCP's
    CheckpointException on every rank: SaveFailed naming the part and the rank, checkpoint.tmp
    removed, the previous checkpoint whole."""
    from test_checkpoints import file_size_limit

    out, (model, tokenizer) = str(tmp_path), demo.model_and_tokenizer(seed=0)
    run = SimpleNamespace(model=model, optimizer=adamw_after_updates(model, 1))
    checkpoint.save_sharded(run, out)
    path = checkpoint.save(out, model, tokenizer, {"step": 1}, sharded=True)
    with file_size_limit(100_000), pytest.raises(SaveFailed) as failed:
        checkpoint.save_sharded(run, out)
    assert str(failed.value).startswith(
        f"could not write a checkpoint into {path}.tmp (AdamW's sharded state, rank 0): "
    )
    assert f"the previous checkpoint, {path}, is intact (step 1)" in str(failed.value)
    assert os.listdir(out) == ["checkpoint"] and checkpoint.verify(path) is None


def test_resume_under_another_number_of_processes_is_refused_naming_torchruns_flag():
    # world_size is no flag: "--world-size was 2" sent the user looking for one
    with pytest.raises(UserError) as refused:
        checkpoint.check_same_flags({"world_size": 2, "fsdp": True}, SimpleNamespace(world_size=3))
    assert str(refused.value).startswith(
        "--resume: flags differ from the checkpoint's (the number of processes (torchrun "
        "--nproc-per-node) was 2, now 3). "
    )


FSDP_ARGV = ["--fsdp", "--steps", "8", "--eval-every", "-1", "--save-every", "0"]
FSDP_ARGV += "--demo-warmup-steps 0 --reward-fn helpers:varied_reward --num-iterations 2".split()


@pytest.fixture(scope="module")
def fsdp_straight(tmp_path_factory):
    """FSDP_ARGV run uninterrupted under torchrun: what the stopped and resumed runs must end as."""
    out = tmp_path_factory.mktemp("fsdp") / "straight"
    torchrun(out, *FSDP_ARGV)
    return out


def adamw_of(run_dir, tmp_path):
    """The AdamW state of a run's checkpoint, every rank's shards put together (DCP's files to one
    torch.save file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    file = tmp_path / f"{run_dir.name}-adamw.pt"
    dcp_to_torch_save(run_dir / "checkpoint" / checkpoint.SHARDED, file)
    return torch.load(file, weights_only=False)


@pytest.mark.slow
def test_fsdp_sigterm_and_resume_end_bit_identical_to_a_run_never_stopped(tmp_path, fsdp_straight):
    """A scheduler's SIGTERM to torchrun: every rank finishes its step and they save it together,
    AdamW's shards beside the whole weights; --resume --fsdp (refused before) continues to the
    weights, metrics rows and AdamW state of the run never stopped. Without the sharded AdamW
    state the resumed run's next update starts from zero moments and the weights differ."""
    out = torchrun_stopped(tmp_path / "run", FSDP_ARGV, lambda p: p.send_signal(signal.SIGTERM))
    logged = len(read_metrics(tmp_path / "run"))
    assert 3 <= logged < 8, out[-3000:]
    assert out.count(f"saved {tmp_path / 'run' / 'checkpoint'} (step {logged})") == 1, out[-3000:]
    shards = sorted(os.listdir(tmp_path / "run" / "checkpoint" / "optimizer"))
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one file per rank
    resumed = torchrun(tmp_path / "run", *FSDP_ARGV, "--resume")
    assert f"resumed from {tmp_path / 'run' / 'checkpoint'} at step {logged}" in resumed
    assert_same_run(fsdp_straight, tmp_path / "run")
    assert same_state(adamw_of(tmp_path / "run", tmp_path), adamw_of(fsdp_straight, tmp_path))


def descendants(pid):
    """The processes below `pid` (children first), read from /proc: torchrun starts each rank in a
    session of its own, so a kill of torchrun's process group leaves the ranks running."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:  # already gone
        return []
    return [p for c in children for p in [c, *descendants(c)]]


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["before the renames", "between the renames"])
def test_fsdp_sigkill_during_a_save_resumes_the_last_complete_checkpoint_exactly(
    tmp_path, fsdp_straight, moment
):
    """SIGKILL to every process of an --fsdp run inside a save (--save-every 1; GRPO_SAVE_PAUSE
    widens its moments): once the new checkpoint.tmp is written (AdamW's shards by both ranks, the
    weights and training_state.pt by rank 0) but not swapped in, and between save's two renames.
    --resume continues from the last complete checkpoint (checkpoint, or checkpoint.old when the
    kill left no checkpoint), never the unfinished checkpoint.tmp, and ends as the run never
    stopped."""
    run = tmp_path / "run"
    argv = [*FSDP_ARGV, "--save-every", "1"]
    landed = {
        "before the renames": lambda: (run / "checkpoint.tmp" / "training_state.pt").is_file(),
        "between the renames": lambda: (
            (run / "checkpoint.old").is_dir() and not (run / "checkpoint").is_dir()
        ),
    }[moment]
    proc = subprocess.Popen(
        torchrun_command(run, *argv),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(torchrun_env(), GRPO_SAVE_PAUSE="0.5"),
    )
    log = run / "metrics.jsonl"
    wait_for(
        lambda: log.exists() and len(log.read_text().splitlines()) >= 3 and landed(),
        proc,
        f"a save of step 3 or later {moment}",
    )
    for pid in [*descendants(proc.pid), proc.pid]:  # the ranks (their own sessions), then torchrun
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    left = sorted(n for n in os.listdir(run) if n.startswith("checkpoint"))
    last = run / ("checkpoint" if moment == "before the renames" else "checkpoint.old")
    assert left == sorted([last.name, "checkpoint.tmp"])
    assert checkpoint.find_last(str(run), quiet=True) == str(last)
    step = checkpoint.checkpoint_step(str(last))
    assert step >= 2
    resumed = torchrun(run, *argv, "--resume")
    assert f"resumed from {last} at step {step}" in resumed
    assert_same_run(fsdp_straight, run)
