"""Tools in the loop (tools.py): the call protocol in the decode loop, the loss mask of forced
tokens, and the bugs other trainers shipped here, each by its numbers. No download: a tiny Llama
over a word-level vocabulary, scripted by a forward hook so that it writes a chosen exchange."""

import copy
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import get_scheduler

import config
import data
import grpo
import sampling
import tools
import trainer
from helpers import ROOT, assert_same_run, read_metrics, scripted
from support import checkpoint, demo
from support.errors import UserError
from support.worker import Worker

WORDS = ["<pad>", "<eos>", "<unk>", "q", "<tool>", "</tool>", "<result>", "</result>", "calc"]
WORDS += ["12", "x", "y"]
ID = {w: i for i, w in enumerate(WORDS)}


# "sampled 3 tokens, forced 4, sampled 2": <tool> calc </tool> | <result> 12 12 </result> | 12 <eos>
EXCHANGE = {"q": "<tool>", "<tool>": "calc", "calc": "</tool>", "</result>": "12", "12": "<eos>"}


def exchange(tool_result="12 12", max_new_tokens=12, group_size=2, **limits):
    """(model, tokenizer, rollouts) of the scripted exchange: prompt "q", G completions."""
    model, tok = demo.tiny_llama(len(WORDS), 0), demo.word_tokenizer(WORDS)
    toolbox = tools.Tools({"calc": lambda arguments: tool_result}, **limits)
    handle = scripted(model, EXCHANGE, WORDS)
    settings = sampling.Sampling(1.0, 0, 1.0, max_new_tokens)
    rollouts = sampling.sample_rollouts(model, tok, ["q"], settings, group_size, tools=toolbox)
    handle.remove()
    return model, tok, rollouts


def test_the_worked_exchange_masks_forced_tokens_out_of_the_loss_and_every_length():
    _, _, r = exchange()
    words = "<tool> calc </tool> <result> 12 12 </result> 12 <eos>".split()
    assert r.input_ids[0, r.prompt_length :].tolist() == [ID[w] for w in words]
    assert r.forced[0].tolist() == [False] * 3 + [True] * 4 + [False] * 2
    assert r.completion_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1]  # the loss
    assert r.attention_mask[0, r.prompt_length :].tolist() == [1] * 9  # attention: all of it
    assert r.lengths.tolist() == [5, 5]  # |o_i| counts sampled tokens
    assert r.truncated.tolist() == [False, False]
    assert r.tool_calls.tolist() == [1, 1] and r.tool_errors.tolist() == [0, 0]
    assert r.tool_malformed.tolist() == [0, 0]
    assert r.texts[0] == "<tool> calc </tool> <result> 12 12 </result> 12"
    # grpo's 1/|o_i| and DAPO's Σ|o_i| count the 5 sampled tokens of each of the 2 completions;
    # Dr. GRPO's constant stays N · max_new_tokens
    assert grpo.loss_denominator(r.completion_mask, "dapo") == 10
    assert grpo.loss_denominator(r.completion_mask, "dr_grpo", 12) == 24
    # the micro-batch keeps every column up to the last token in the loss (9), not the count of
    # tokens in the loss (5): TRL #5144's mask longer or shorter than the completion cannot happen
    ids, attn, keep = trainer.micro_batch_inputs(r, slice(0, 2))
    assert keep == 9 and ids.shape[1] == r.prompt_length + 9


def hand_loss(model, r, advantages, mask):
    """Eq. 3 with μ = 1, β = 0 by hand from the model's own logits (not sampling's chunked
    lm-head): 1/N Σ_i 1/|o_i| Σ_t ratio · Â over the tokens of `mask`, negated."""
    P = r.prompt_length
    logits = model(input_ids=r.input_ids, attention_mask=r.attention_mask).logits[:, P - 1 : -1]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, r.input_ids[:, P:, None])[..., 0]
    ratio = torch.exp(logps - logps.detach())
    per_token = ratio * advantages[:, None] * mask
    return -(per_token.sum(1) / mask.sum(1)).mean()


def test_loss_and_gradient_equal_the_hand_masked_ones_and_forced_logprobs_never_reach_the_ratio():
    model, _, r = exchange()
    advantages = torch.tensor([1.0, -0.5])
    hand_mask = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 1, 1]] * 2, dtype=torch.float32)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    hand_loss(reference, r, advantages, hand_mask).backward()
    optimizer.step()
    expected = {n: p.detach() for n, p in reference.named_parameters()}

    def update(old_logps):
        policy = copy.deepcopy(model)
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        stats, _ = trainer.policy_update(
            policy,
            optimizer,
            get_scheduler("constant", optimizer),
            r,
            advantages,
            old_logps,
            None,
            objective=trainer.LossSettings(0.2, None, 0.0, "grpo", "token", 12, None),
            micro_batch_size=2,
            max_grad_norm=0,
        )
        return stats, {n: p.detach() for n, p in policy.named_parameters()}

    stats, weights = update(None)
    for name, value in weights.items():
        # fp32, the same model and tokens through two computations of the log-probs: 1e-6
        assert torch.allclose(value, expected[name], atol=1e-6), name
    # π_old's log-probs garbage on the forced tokens (a ratio of e^±40 there): nothing changes,
    # no token is clipped, the token count stays the 10 sampled tokens
    with torch.no_grad():
        P = r.prompt_length
        logits = model(input_ids=r.input_ids, attention_mask=r.attention_mask).logits
        old = torch.log_softmax(logits[:, P - 1 : -1].float(), -1)
        old = old.gather(-1, r.input_ids[:, P:, None])[..., 0]
    garbage = old.masked_fill(r.forced, -40.0)
    stats_old, weights_old = update(garbage)
    assert stats_old["clip_frac"] == 0.0
    for name, value in weights_old.items():
        assert torch.allclose(value, expected[name], atol=1e-6), name


def test_forced_tokens_stay_out_of_the_entropy_mask_the_sampler_weights_and_the_mismatch():
    # The decode keeps no log-prob for a forced token (0 there); and whatever the sampler's
    # log-prob of a forced token says (here e^±40 away from the trainer's), the loss, the update
    # and the mismatch are those of the sampled tokens alone, with CISPO, the top-ρ entropy mask,
    # the off-policy mask and the per-token correction all on.
    model, tok = demo.tiny_llama(len(WORDS), 0), demo.word_tokenizer(WORDS)
    toolbox = tools.Tools({"calc": lambda arguments: "12 12"})
    handle = scripted(model, EXCHANGE, WORDS)
    settings = sampling.Sampling(1.0, 0, 1.0, 12, keep_logps=True)
    r = sampling.sample_rollouts(model, tok, ["q"], settings, 2, tools=toolbox)
    handle.remove()
    assert (r.sampler_logps[r.forced] == 0).all() and (r.log_kept == 0).all()
    objective = trainer.LossSettings(
        0.2, 3.0, 0.0, "dapo", "token", 12, None, "cispo", top_entropy=0.5, off_policy_threshold=0.0
    )

    def update(sampler_logps):
        policy = copy.deepcopy(model)
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        rollouts = dataclasses.replace(r, sampler_logps=sampler_logps)
        stats, _ = trainer.policy_update(
            policy, optimizer, get_scheduler("constant", optimizer), rollouts,
            torch.tensor([1.0, -0.5]), None, None, objective=objective, micro_batch_size=2,
            correction=("token_truncate", 0.0, 3.0), max_grad_norm=0,
        )  # fmt: skip
        return stats, [p.detach() for p in policy.parameters()]

    stats, weights = update(r.sampler_logps)
    for garbage in (-40.0, 40.0):
        again, moved = update(r.sampler_logps.masked_fill(r.forced, garbage))
        assert again == stats  # every statistic, the mismatch and the shares included
        assert all(torch.equal(a, b) for a, b in zip(moved, weights))
    # the shares count the 10 sampled tokens (entropy mask: about half of them) and 2 completions
    assert 0.4 <= stats["entropy_dropped"] <= 0.6
    assert stats["mismatch_max_ratio"] > 1  # the scripted sampler is sure, the real model is not


def test_pad_equal_to_eos_keeps_the_sampled_eos_in_the_loss_and_forced_tokens_attended():
    # TRL #4974: with pad == EOS a mask built from the pad id drops the EOS from the loss
    model, tok, r = exchange()
    tok.pad_token = tok.eos_token
    assert tok.pad_token_id == tok.eos_token_id == ID["<eos>"]
    assert r.completion_mask[0, 8] == 1 and r.input_ids[0, r.prompt_length + 8] == ID["<eos>"]
    assert r.attention_mask[0, r.prompt_length + 3 : r.prompt_length + 7].tolist() == [1] * 4


def test_a_result_holding_markers_or_eos_neither_calls_a_tool_nor_ends_the_completion():
    _, _, r = exchange(tool_result="<tool> calc </tool> <eos>")
    ids = r.input_ids[0, r.prompt_length :].tolist()
    # the forced block: <result> <tool> calc </tool> <eos> </result>; then 12 <eos> sampled
    assert ids[3:9] == [ID[w] for w in "<result> <tool> calc </tool> <eos> </result>".split()]
    assert ids[9:] == [ID["12"], ID["<eos>"]]
    assert r.tool_calls.tolist() == [1, 1] and not r.truncated.any()
    assert r.lengths.tolist() == [5, 5]


def test_a_result_past_the_budget_is_cut_and_the_completion_counts_as_truncated():
    _, _, r = exchange(max_new_tokens=5)  # 3 sampled, then 2 of the 4 forced tokens
    assert r.input_ids.shape[1] - r.prompt_length == 5
    assert r.forced[0].tolist() == [False] * 3 + [True] * 2
    assert r.truncated.tolist() == [True, True] and r.lengths.tolist() == [3, 3]


def test_a_result_is_cut_to_max_tool_result_tokens():
    _, _, r = exchange(tool_result="12 12 12 12 12", max_result_tokens=2)
    words = "<tool> calc </tool> <result> 12 12 </result> 12 <eos>".split()
    assert r.input_ids[0, r.prompt_length :].tolist() == [ID[w] for w in words]


def test_a_huge_result_is_cut_to_characters_before_it_is_tokenized_not_after():
    # a 10 MB result used to be tokenized whole (minutes for a real tokenizer), then cut to
    # --max-tool-result-tokens; now the tokenizer never sees more than result_chars() of it
    tok, seen = demo.word_tokenizer(WORDS), []

    class Spy:  # the tokenizer, recording the length of each text it is handed
        def get_vocab(self):
            return tok.get_vocab()

        def __call__(self, text, **kw):
            seen.append(len(text))
            return tok(text, **kw)

    session = tools.Tools({}, max_result_tokens=2).session(Spy(), 1, 20)
    ten_mb = "12 " * 3_500_000
    assert session.result_tokens(ten_mb) == [ID[w] for w in "<result> 12 12 </result>".split()]
    # twice the longest token's text ("</result>", 9 characters) for 2 + 1 tokens
    assert session.result_chars() == 2 * 3 * 9 and max(seen) <= 54
    _, _, r = exchange(tool_result=ten_mb, max_result_tokens=2)  # the whole exchange, as before
    words = "<tool> calc </tool> <result> 12 12 </result> 12 <eos>".split()
    assert r.input_ids[0, r.prompt_length :].tolist() == [ID[w] for w in words]


def test_calls_past_max_tool_calls_stay_plain_text():
    # after each result the script calls again: <tool> calc </tool> <result> y </result> <tool> ...
    model, tok = demo.tiny_llama(len(WORDS), 0), demo.word_tokenizer(WORDS)
    again = dict(EXCHANGE, **{"</result>": "<tool>", "</tool>": "y", "y": "<eos>"})
    again["calc"] = "</tool>"
    toolbox = tools.Tools({"calc": lambda a: "x"}, max_calls=1)
    handle = scripted(model, again, WORDS)
    r = sampling.sample_rollouts(
        model, tok, ["q"], sampling.Sampling(1.0, 0, 1.0, 20), 2, tools=toolbox
    )
    handle.remove()
    words = "<tool> calc </tool> <result> x </result> <tool> calc </tool> y <eos>".split()
    assert r.input_ids[0, r.prompt_length :].tolist() == [ID[w] for w in words]
    assert r.tool_calls.tolist() == [1, 1] and int(r.forced[0].sum()) == 3


def test_a_tool_that_raises_returns_its_error_and_an_unknown_tool_is_named():
    def boom(arguments):
        raise ValueError("no such thing")

    toolbox = tools.Tools({"calc": boom})
    assert toolbox.run("calc 1") == ("error: no such thing", "raised")
    # in the decode: an error, and not a malformed call
    model, tok = demo.tiny_llama(len(WORDS), 0), demo.word_tokenizer(WORDS)
    handle = scripted(model, EXCHANGE, WORDS)
    settings = sampling.Sampling(1.0, 0, 1.0, 12)
    r = sampling.sample_rollouts(model, tok, ["q"], settings, 2, tools=toolbox)
    handle.remove()
    assert r.tool_errors.tolist() == [1, 1] and r.tool_malformed.tolist() == [0, 0]
    assert toolbox.run("nope 1") == ("error: no tool named 'nope' (tools: calc)", "malformed")
    with pytest.raises(UserError, match="returned a int, not a string"):
        tools.Tools({"calc": lambda a: 3}).run("calc 1")
    _, _, r = exchange()
    calc = tools.Tools({"calculator": tools.BUILTIN_TOOLS["calculator"]})
    assert calc.run("calculator 123*45") == ("5535", None)
    assert calc.run("calculator 9**9**9")[1] == "raised"
    assert calc.run("calculator 9**9**9")[0].startswith("error: ")


@pytest.mark.slow  # a subprocess or the worker process: over a second
def test_a_hanging_tool_in_the_worker_stops_the_run_naming_it(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text(
        textwrap.dedent(
            """
            import time

            def slow(arguments):
                time.sleep(60)

            def echo(arguments):
                return arguments[::-1]

            def fails(arguments):
                raise KeyError(arguments)
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    args = config.parse_args(
        ["--demo", "--tool", "my_tools:slow,my_tools:echo", "--tool", "my_tools:fails"]
        + ["--tool-timeout", "1", "--output-dir", str(tmp_path / "run")]
    )
    worker = Worker(1.0)
    toolbox = tools.from_flags(args, worker)
    assert list(toolbox.functions) == ["slow", "echo", "fails"]
    assert toolbox.run("echo abc") == ("cba", None)
    assert toolbox.run("fails k") == ("error: 'k'", "raised")
    with pytest.raises(UserError, match=r"tool 'slow' \(my_tools:slow\) did not return within"):
        toolbox.run("slow 1")
    assert toolbox.run("echo again") == ("niaga", None)  # a fresh worker after the kill
    worker.close()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--num-beams", "8"], "beam search"),
        (["--tool", "nomodule"], "expected MODULE:FUNCTION"),
        (["--max-tool-calls", "0"], "--max-tool-calls must be at least 1"),
        (["--tool-timeout", "nan"], "--tool-timeout must be a finite number"),
    ],
)
def test_flags_that_cannot_work_with_tools_are_refused_before_any_model_loads(extra, message):
    with pytest.raises(UserError, match=message):
        args = config.parse_args(
            ["--demo", "--tool", "calculator", "--output-dir", "/tmp/x"] + extra
        )
        tools.from_flags(args)


@pytest.mark.parametrize("flag", ["--tool", "--reward-fn", "--reward-model"])
@pytest.mark.parametrize("value", ["", " ", ","])
def test_a_flag_value_that_names_nothing_is_refused_not_dropped(flag, value):
    # --tool '' was dropped silently: the run trained without its tool (--reward-fn '' with the
    # task's own rewards)
    with pytest.raises(UserError) as refused:
        config.parse_args(["--demo", "--output-dir", "/tmp/x", flag, value])
    assert str(refused.value) == (
        f"{flag} {value!r} names nothing: pass a name (e.g. MODULE:FUNCTION), or drop {flag} (an "
        "empty shell variable, perhaps)."
    )
    # a trailing comma after a name is not a value that names nothing
    assert config.parse_args(
        ["--demo", "--output-dir", "/tmp/x", "--tool", "calculator,"]
    ).tool == ["calculator"]


def test_rewards_may_ask_for_tool_calls_and_no_data_field_may_take_the_name():
    def uses(completions, answers, tool_calls):
        return [float(n) for n in tool_calls]

    import rewards

    task = data.Task([], [], None, rewards.weighted([("uses", uses)], [1.0]))
    total, _ = task.score([{"prompt": "p", "answer": "a"}], ["x", "y"], 2, [1, 1], [3, 0])
    assert total.tolist() == [3.0, 0.0]
    with pytest.raises(ValueError, match="may not be named 'tool_calls'"):
        data.own_row("f:1", {"prompt": "p", "answer": "a", "tool_calls": 1}, "prompt", "answer")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tools_under_cpu_autocast_give_the_same_exchange_and_a_finite_loss(dtype):
    model, tok = demo.tiny_llama(len(WORDS), 0), demo.word_tokenizer(WORDS)
    handle = scripted(model, EXCHANGE, WORDS)
    toolbox = tools.Tools({"calc": lambda a: "12 12"})
    r = sampling.sample_rollouts(
        model, tok, ["q"], sampling.Sampling(1.0, 0, 1.0, 12), 2, dtype, toolbox
    )
    handle.remove()
    assert r.completion_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1]
    with sampling.autocast("cpu", dtype):
        logps = sampling.token_logprobs(model, r.input_ids, r.attention_mask, 9, group_size=2)
    loss = grpo.grpo_loss(logps, None, None, torch.tensor([1.0, -1.0]), r.completion_mask, beta=0)
    assert torch.isfinite(loss)


# --------------------------------------------------------------------------------------------------
# The tool demo end to end (slow: its warm-up alone is about 30 s on a 2-core CPU).

HANGING_CALCULATOR = """
from support.calculator import calculator as exact

calls = 0


def calculator(arguments):
    global calls
    calls += 1
    if calls > 150:  # a few steps in (each step makes 30-130 calls): hangs, deaf to SIGTERM
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    return exact(arguments)
"""


def train_py(cwd, *argv):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "trainer.py"), *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_the_tool_demo_learns_to_call_the_calculator_on_held_out_sums(tmp_path):
    out = tmp_path / "run"
    argv = ["--demo", "--tool", "calculator", "--steps", "40", "--eval-every", "40"]
    code, stdout, err = train_py(tmp_path, *argv, "--output-dir", str(out))
    assert code == 0, err
    before, after = [row for row in read_metrics(out) if "eval/correctness" in row]
    print(before, after)
    # measured (seed 0, 2026-11-25): tool use 0.25 -> 0.98, correctness 0.28 -> 0.79 at step 50
    # of 150; the bars leave room for another machine's float order
    assert before["eval/tool_use"] < 0.5 and after["eval/tool_use"] > 0.8
    assert after["eval/correctness"] - before["eval/correctness"] > 0.3
    assert "tools 0." in stdout or "tools 1." in stdout  # the progress line's tool use


@pytest.mark.slow
def test_a_tool_that_hangs_mid_run_stops_it_naming_the_tool_saved(tmp_path):
    (tmp_path / "my_tools.py").write_text(HANGING_CALCULATOR)
    out = tmp_path / "run"
    argv = ["--demo", "--tool", "my_tools:calculator", "--tool-timeout", "2", "--steps", "30"]
    code, _, err = train_py(tmp_path, *argv, "--eval-every", "-1", "--output-dir", str(out))
    assert code == 2, err
    assert "tool 'calculator' (my_tools:calculator) did not return within --tool-timeout 2 s" in err
    step = checkpoint.load_state(str(out / "checkpoint"))["step"]
    assert 1 <= step < 30 and len(read_metrics(out)) == step


@pytest.mark.slow
def test_resume_is_exact_with_a_deterministic_tool(tmp_path):
    argv = ["--demo", "--tool", "calculator", "--eval-every", "-1", "--demo-warmup-steps", "200"]
    argv += ["--lr-scheduler", "constant"]  # a run cut at step 2 then has the same schedule
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train_py(tmp_path, *argv, "--steps", "4", "--output-dir", str(straight))[0] == 0
    assert train_py(tmp_path, *argv, "--steps", "2", "--output-dir", str(resumed))[0] == 0
    code, _, err = train_py(
        tmp_path, *argv, "--steps", "4", "--output-dir", str(resumed), "--resume"
    )
    assert code == 0, err
    assert_same_run(straight, resumed)


@pytest.mark.slow
def test_a_compiled_decode_forces_the_same_tokens():
    # forced tokens are data: the compiled step (fixed shapes) writes the exchange as eager does
    model, tok = demo.tiny_llama(len(WORDS), 0), demo.word_tokenizer(WORDS)
    sampling.compile_model(model, backend="eager")
    handle = scripted(model, EXCHANGE, WORDS)
    toolbox = tools.Tools({"calc": lambda arguments: "12 12"})
    r = sampling.sample_rollouts(
        model, tok, ["q"], sampling.Sampling(1.0, 0, 1.0, 12), 2, tools=toolbox
    )
    handle.remove()
    words = "<tool> calc </tool> <result> 12 12 </result> 12 <eos>".split()
    assert r.input_ids[0, r.prompt_length :].tolist() == [ID[w] for w in words]
    assert r.completion_mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 1, 1]


@pytest.mark.slow
def test_tool_heldout_evaluates_a_model_dir_on_larger_operands_with_the_tasks_reward(
    tmp_path, capsys
):
    """scripts/tool_heldout.py (docs/tools.md's held-out numbers at 4 x 3 digits): the task's
    prompt and reward on data.larger_multiplication_rows, --eval-only's report; a bad --operands
    is one line."""
    from helpers import tiny_model_dir
    from scripts import tool_heldout

    model = tiny_model_dir(tmp_path)
    flags = ["--model", model, "--device", "cpu", "--eval-limit", "2", "--eval-samples", "2"]
    result = tool_heldout.main([*flags, "--max-new-tokens", "4", "--operands", "2x2"])
    out = capsys.readouterr().out
    assert "held-out: 2-digit x 2-digit products, seed 43" in out
    assert "held-out 2 rows (the first 2 of 200) from given (larger operands" in out
    assert {"correctness", "correctness_pass@2", "correctness_maj@2", "tool_use"} <= set(result)
    assert {"tool_malformed", "tool_well_formed"} <= set(result)
    with pytest.raises(SystemExit, match="--operands takes AxB"):
        tool_heldout.main([*flags, "--operands", "4by3"])
