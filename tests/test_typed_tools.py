"""Typed tools, the Hermes/Qwen JSON call format and environments (tools.py, support/tool_calls.py;
issue 55, items 1-3). Each bug other trainers shipped here has a test by its number: TRL #5144 (a
tool mask out of step after re-tokenizing), transformers #45419 (dict against string `arguments`),
TRL PR #5346 (tools=[] given to the chat template), TRL PR #5833 (a forked template refused by exact
matching). No download: tiny Llamas over word-level vocabularies, scripted by a forward hook, and
chat templates written here."""

import copy
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import get_scheduler
from transformers.utils.chat_template_utils import get_json_schema

import config
import data
import grpo
import rewards
import sampling
import tools
import trainer
from helpers import ROOT, assert_same_run, read_metrics, scripted
from support import checkpoint, demo, report, tool_calls
from support.errors import UserError
from support.worker import Worker

# --------------------------------------------------------------------------------------------------
# Item 1: typed functions as tools.


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def pick(kind: str, sizes: list[int], note: str | None = None) -> dict:
    """Pick one of a kind.

    Args:
        kind: what to pick
        sizes: its sizes
        note: a note
    """
    return {"kind": kind, "total": sum(sizes), "note": note}


def test_a_typed_function_takes_get_json_schema_and_today_s_tools_stay_plain():
    schema = get_json_schema(add)
    del schema["function"]["return"]
    assert tool_calls.describe_tool(add) == {"schema": schema, "plain": False}
    assert tool_calls.describe_tool(add, "plus")["schema"]["function"]["name"] == "plus"

    def plain(arguments: str) -> str:
        return arguments

    def untyped(query):
        return query

    for fn in (plain, untyped, lambda arguments: arguments, tools.BUILTIN_TOOLS["calculator"]):
        described = tool_calls.describe_tool(fn, "t")
        assert described["plain"] and described["schema"]["function"]["parameters"]["required"]

    def no_docstring(a: int):
        return a

    with pytest.raises(UserError, match="'no_docstring' takes typed arguments.*docstring"):
        tool_calls.describe_tool(no_docstring)


def test_a_typed_tool_is_called_with_a_json_object_in_the_markers_format():
    toolbox = tools.Tools({"add": add, "pick": pick})
    assert toolbox.specs["add"].plain is False
    assert toolbox.run('add {"a": 2, "b": 3}') == ("5", None)
    # a value that is not text is written as JSON
    assert toolbox.run('pick {"kind": "x", "sizes": [1, 2]}') == (
        '{"kind": "x", "total": 3, "note": null}',
        None,
    )
    # a plain tool keeps its text as it is, and a typed one without arguments takes none
    assert tools.Tools({"echo": lambda arguments: arguments}).run("echo 1 2 {") == ("1 2 {", None)


# (format, body, the error's start): each call that cannot run is an error result, never a crash
BAD_CALLS = [
    ("markers", 'add {"a": 2, "b": 3', "error: the arguments are not valid JSON"),
    ("markers", "add [2, 3]", "error: the arguments must be a JSON object, not array"),
    ("markers", 'sub {"a": 2}', "error: no tool named 'sub' (tools: add, pick)"),
    ("markers", 'add {"a": 2, "b": 3, "c": 4}', "error: add has no argument 'c' (its arguments"),
    ("markers", 'add {"a": 2}', "error: add needs the argument 'b'"),
    ("markers", 'add {"a": 2, "b": "3"}', "error: add's argument 'b' must be integer, not string"),
    ("markers", 'add {"a": 2, "b": true}', "error: add's argument 'b' must be integer, not bool"),
    ("markers", 'add {"a": 2, "b": 3.5}', "error: add's argument 'b' must be integer, not number"),
    ("markers", 'pick {"kind": "x", "sizes": [1, "2"]}', "error: pick's argument 'sizes' item 1"),
    (
        "hermes",
        '{"name": "add", "arguments": {"a": 2, "b": 3}',
        "error: the call is not valid JSON",
    ),
    ("hermes", '{"name": "sub", "arguments": {}}', "error: no tool named 'sub'"),
    ("hermes", '{"name": "add", "arguments": {"a": 2, "b": 3, "c": 4}}', "error: add has no arg"),
    ("hermes", '{"name": "add", "arguments": {"a": 2}}', "error: add needs the argument 'b'"),
    # transformers #45419: a string where the object belongs, even one holding the right JSON
    (
        "hermes",
        '{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}',
        'error: "arguments" must',
    ),
    ("hermes", '{"name": "add", "arguments": [2, 3]}', 'error: "arguments" must be a JSON object'),
    ("hermes", '{"arguments": {"a": 2, "b": 3}}', 'error: a call is a JSON object {"name"'),
    ("hermes", '{"name": "add", "arguments": {}, "id": 1}', 'error: a call has "name" and'),
    ("hermes", "[1, 2]", 'error: a call is a JSON object {"name"'),
]


@pytest.mark.parametrize("format_name, body, error", BAD_CALLS)
def test_each_call_that_cannot_run_is_an_error_result_the_model_reads(format_name, body, error):
    text, failed = tools.Tools({"add": add, "pick": pick}, format=format_name).run(body)
    assert failed == "malformed" and text.startswith(error), text


def test_the_same_calls_run_in_the_hermes_format_and_a_plain_tool_takes_its_one_argument():
    toolbox = tools.Tools(
        {"add": add, "calculator": tools.BUILTIN_TOOLS["calculator"]}, format="hermes"
    )
    assert toolbox.run(' {"name": "add", "arguments": {"a": 2, "b": 3}} ') == ("5", None)
    call = '{"name": "calculator", "arguments": {"arguments": "12*34"}}'
    assert toolbox.run(call) == ("408", None)
    text, failed = toolbox.run('{"name": "calculator", "arguments": {"arguments": 12}}')
    assert failed == "malformed" and "must be string" in text


def test_arguments_are_checked_against_the_schema_before_any_call():
    calls = []

    def spy(a: int) -> str:
        """Spy.

        Args:
            a: a number
        """
        calls.append(a)
        return "ok"

    toolbox = tools.Tools({"spy": spy})
    assert toolbox.run('spy {"a": "1"}')[1] == toolbox.run("spy {}")[1] == "malformed"
    assert calls == []
    assert toolbox.run('spy {"a": 1}') == ("ok", None) and calls == [1]


def test_the_tool_columns_of_a_worked_step():
    # three completions: two calls, one of them to a tool that raised on well-formed arguments;
    # one call no schema takes; no call
    calls, errors, malformed = (
        torch.tensor([2, 1, 0]),
        torch.tensor([1, 1, 0]),
        torch.tensor([0, 1, 0]),
    )
    columns = report.tool_columns(calls, errors, malformed)
    assert {k: v.tolist() for k, v in columns.items()} == {
        "tool_calls": [2.0, 1.0, 0.0],
        "tool_use": [1.0, 1.0, 0.0],
        "tool_errors": [1.0, 1.0, 0.0],
        "tool_malformed": [0.0, 1.0, 0.0],
        "tool_well_formed": [1.0, 0.0, 0.0],  # called, and every call well-formed: the first
    }
    metrics = report.tool_metrics(calls, errors, malformed)
    assert metrics == pytest.approx(
        {"tool_calls": 1.0, "tool_use": 2 / 3, "tool_errors": 2 / 3, "tool_malformed": 1 / 3,
         "tool_well_formed": 1 / 3}, abs=1e-7  # float32 means of thirds
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Item 2: the Hermes format in the decode loop, and the tools in the prompt.

WORDS = ["<pad>", "<eos>", "<unk>", "q", "<tool_call>", "</tool_call>", "<tool_response>"]
WORDS += ["</tool_response>", '{"name":', '"add",', '"arguments":', '{"a":', "2,", '"b":']
WORDS += ["3}}", "3}", "5", "12", "<tool>", "</tool>", "<result>", "</result>", "count", "y"]
WORDS += ["1", "2", "3", "4"]
ID = {w: i for i, w in enumerate(WORDS)}

# sampled 9 tokens, forced 3, sampled 2
CALL = '<tool_call> {"name": "add", "arguments": {"a": 2, "b": 3}} </tool_call>'
HERMES = dict(zip(["q", *CALL.split()], CALL.split()))
HERMES.update({"</tool_response>": "12", "12": "<eos>"})


def rollouts_of(script, toolbox, prompts=("q",), group_size=2, max_new_tokens=20, rows=None):
    """(model, tokenizer, rollouts) of a scripted tiny Llama calling `toolbox`."""
    model, tok = demo.tiny_llama(len(WORDS), 0), demo.word_tokenizer(WORDS)
    handle = scripted(model, script, WORDS)
    settings = sampling.Sampling(1.0, 0, 1.0, max_new_tokens)
    r = sampling.sample_rollouts(
        model, tok, list(prompts), settings, group_size, tools=toolbox, rows=rows
    )
    handle.remove()
    return model, tok, r


def test_a_hermes_call_is_parsed_from_the_sampled_tokens_and_its_masks_keep_the_trl_bug_tests():
    model, tok, r = rollouts_of(HERMES, tools.Tools({"add": add}, format="hermes"))
    words = [*CALL.split(), "<tool_response>", "5", "</tool_response>", "12", "<eos>"]
    # token in, token out: the ids are the sampled ones, then the forced ones, nothing re-tokenized
    assert r.input_ids[0, r.prompt_length :].tolist() == [ID[w] for w in words]
    assert r.forced[0].tolist() == [False] * 9 + [True] * 3 + [False] * 2
    assert r.completion_mask[0].tolist() == [1] * 9 + [0] * 3 + [1] * 2
    assert r.attention_mask[0, r.prompt_length :].tolist() == [1] * 14
    assert r.lengths.tolist() == [11, 11] and r.tool_calls.tolist() == [1, 1]
    assert r.tool_errors.tolist() == [0, 0]
    # TRL #5144: the micro-batch keeps every column up to the last token in the loss (14), never
    # the count of tokens in the loss (11)
    ids, attn, keep = trainer.micro_batch_inputs(r, slice(0, 2))
    assert keep == 14 and ids.shape[1] == r.prompt_length + 14
    # TRL PR #6439: one mask for the numerator and the denominator
    assert grpo.loss_denominator(r.completion_mask, "dapo") == 22
    # TRL #4974: pad == EOS keeps the sampled EOS in the loss, the forced tokens attended
    tok.pad_token = tok.eos_token
    assert r.completion_mask[0, 13] == 1 and r.input_ids[0, r.prompt_length + 13] == ID["<eos>"]


def test_a_hermes_exchange_s_loss_and_gradient_equal_the_hand_masked_ones():
    # TRL PR #4975: the loss goes through the same mask as the hand computation, to 1e-6
    model, _, r = rollouts_of(HERMES, tools.Tools({"add": add}, format="hermes"))
    advantages, hand_mask = torch.tensor([1.0, -0.5]), r.completion_mask.float()
    P = r.prompt_length
    reference = copy.deepcopy(model)
    logits = reference(input_ids=r.input_ids, attention_mask=r.attention_mask).logits[:, P - 1 : -1]
    logps = torch.log_softmax(logits.float(), -1).gather(-1, r.input_ids[:, P:, None])[..., 0]
    per_token = torch.exp(logps - logps.detach()) * advantages[:, None] * hand_mask
    (-(per_token.sum(1) / hand_mask.sum(1)).mean()).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    policy = copy.deepcopy(model)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    trainer.policy_update(
        policy, optimizer, get_scheduler("constant", optimizer), r, advantages, None, None,
        objective=trainer.LossSettings(0.2, None, 0.0, "grpo", "token", 20, None),
        micro_batch_size=2, max_grad_norm=0,
    )  # fmt: skip
    for (name, mine), theirs in zip(policy.named_parameters(), reference.parameters()):
        assert torch.allclose(mine, theirs, atol=1e-6), name


def test_a_malformed_hermes_call_forces_its_error_and_counts_it():
    script = dict(HERMES, **{'"b":': "3}", "3}": "</tool_call>"})  # one brace short
    toolbox = tools.Tools({"add": add}, format="hermes", max_result_tokens=4)
    _, _, r = rollouts_of(script, toolbox)
    assert r.tool_calls.tolist() == [1, 1] and r.tool_errors.tolist() == [1, 1]
    assert r.tool_malformed.tolist() == [1, 1]
    forced = r.input_ids[0, r.prompt_length :][r.forced[0]].tolist()
    # <tool_response> error: the call is </tool_response>, the rest of its text cut
    assert forced[0] == ID["<tool_response>"] and forced[-1] == ID["</tool_response>"]
    assert len(forced) == 6 and r.texts[0].endswith("</tool_response> 12")


# A minimal tool-capable chat template of our own: a tools line whenever `tools` is given (None
# leaves it out; [] would write an empty one: TRL PR #5346), then one line per message.
TEMPLATE = (
    "{% if tools is not none %}[tools]{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
# The same template as a fork edits it (other markers, whitespace, a macro, another name for the
# loop variable): read as it is, never matched against a known copy (TRL PR #5833).
FORK = (
    "{%- macro line(r, c) -%}<<{{ r }}>>{{ c }}\n{%- endmacro -%}\n"
    "{%- if tools is not none -%}<<tools>>{%- for fn in tools %} {{ fn['function']['name'] }}"
    "{%- endfor %}\n{% endif -%}"
    "{%- for turn in messages -%}{{ line(turn.role, turn.content) }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<<assistant>>{%- endif -%}"
)
# A template that takes no tools (as SmolLM2's): the tools go into its system message.
NO_TOOLS = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


def templated(template):
    tok = demo.word_tokenizer(WORDS)
    tok.chat_template = template
    return tok


def test_the_tools_are_rendered_by_a_template_that_takes_them_and_never_as_an_empty_list():
    toolbox = tools.Tools({"add": add, "pick": pick}, format="hermes")
    template = tools.prompt_template(data.chat_prompt, toolbox)
    prompt = template(templated(TEMPLATE), "What is 2 + 3?")
    assert prompt == "[tools] add pick\n[user] What is 2 + 3?\n[assistant] "
    # the fork is read the same way; the markers format leaves the task's prompt as it is
    assert tools.template_reads_tools(FORK) and not tools.template_reads_tools(NO_TOOLS)
    fork = template(templated(FORK), "What is 2 + 3?")
    assert fork == "<<tools>> add pick<<user>>What is 2 + 3?<<assistant>>"
    markers = tools.prompt_template(data.chat_prompt, tools.Tools({"add": add}))
    assert markers is data.chat_prompt
    # TRL PR #5346: no tools, no tools= at all (a run without tools has no ToolPrompt, and the
    # text of no tools cannot be made)
    assert tools.prompt_template(data.chat_prompt, None) is data.chat_prompt
    assert data.chat_prompt(templated(TEMPLATE), "hi") == "[user] hi\n[assistant] "
    with pytest.raises(ValueError, match="at least one tool"):
        tool_calls.tools_text([], "hermes")
    # a template with transformers' own tags is read by name
    tagged = "{% generation %}{{ tools }}{% endgeneration %}"
    assert tools.template_reads_tools(tagged) and not tools.template_reads_tools("{% a %}")


def test_a_template_without_tools_gets_them_in_its_system_message_and_no_template_before_it():
    toolbox = tools.Tools({"add": add}, format="hermes")
    text = tool_calls.tools_text(toolbox.all_specs(), "hermes")
    assert '"name": "add"' in text and "<tool_call>" in text and "<tool_response>" in text
    template = tools.prompt_template(data.chat_prompt, toolbox)
    assert template(templated(NO_TOOLS), "hi") == f"[system] {text}\n[user] hi\n[assistant] "
    with_system = tools.prompt_template(
        lambda tok, q: data.chat_prompt(tok, q, system_prompt="Be brief."), toolbox
    )
    expected = f"[system] Be brief.\n\n{text}\n[user] hi\n[assistant] "
    assert with_system(templated(NO_TOOLS), "hi") == expected
    assert template(demo.word_tokenizer(WORDS), "hi") == f"{text}\n\nhi\n"  # no chat template


def test_a_forked_template_s_calls_parse_the_same_the_format_being_a_flag_not_a_guess():
    # nothing of the template is read to parse a call: the same sampled ids give the same call
    for template in (TEMPLATE, FORK, NO_TOOLS):
        model, tok = demo.tiny_llama(len(WORDS), 0), templated(template)
        handle = scripted(
            model, dict(HERMES, **{"<unk>": "<tool_call>"}), WORDS
        )  # after "[assistant]"
        toolbox = tools.Tools({"add": add}, format="hermes")
        prompt = tools.prompt_template(data.chat_prompt, toolbox)(tok, "q")
        r = sampling.sample_rollouts(
            model, tok, [prompt], sampling.Sampling(1.0, 0, 1.0, 20), 2, tools=toolbox
        )
        handle.remove()
        assert r.tool_calls.tolist() == [1, 1] and r.tool_errors.tolist() == [0, 0], template


# --------------------------------------------------------------------------------------------------
# Item 3: environments, one per completion, in the worker process.

ENVS = """
import os, signal, time

from support.calculator import calculator as exact

LEAK = []


def live(cls):
    # run in the worker as an adapter: how many environments it holds
    from support.tool_calls import ENVIRONMENTS

    return len(ENVIRONMENTS)


class Counter:
    reward_method = "counted"

    def reset(self, answer, start=0):
        self.answer, self.calls = answer, int(start)

    def count(self, arguments):
        self.calls += 1
        return str(self.calls)

    def counted(self, completion):
        return float(self.calls)


class Broken(Counter):
    def reset(self, answer):
        raise ValueError("no prices for " + answer)


class Slow(Counter):
    def count(self, arguments):
        time.sleep(60)


class Leaky(Counter):
    def count(self, arguments):
        LEAK.append(bytearray(300 * 2**20))
        return "ok"


class Named(Counter):
    reward_method = "reward"

    def reward(self, completion):
        return 1.0


class Shop:
    reward_method = "paid"

    def reset(self, prices):
        self.prices, self.looked = prices, []

    def price(self, item: str) -> int:
        \"\"\"The price of one item.

        Args:
            item: its name
        \"\"\"
        self.looked.append(item)
        return self.prices[item]

    def paid(self, completion):
        return float(len(self.looked))


class Calc:
    # --demo's calculator, as an environment: the demo's model already writes its calls
    reward_method = "called"

    resets = 0  # in the worker process, across instances

    def reset(self, answer):
        self.calls = 0
        Calc.resets += 1
        if Calc.resets > int(os.environ.get("GRPO_RAISE_AFTER", 10**9)):
            raise RuntimeError("the price list is gone")
        marker = os.environ.get("GRPO_KILL_MARKER")
        if marker and not os.path.exists(marker):
            with open(marker + ".resets", "a") as f:
                f.write("x")
            if os.path.getsize(marker + ".resets") > int(os.environ["GRPO_KILL_AFTER"]):
                open(marker, "w").close()
                os.kill(os.getppid(), signal.SIGKILL)  # the trainer, in the middle of a step

    def calculator(self, arguments):
        self.calls += 1
        return exact(arguments)

    def called(self, completion):
        return float(self.calls > 0)
"""

# <tool> count </tool>, then again after each result; once the calls run out: y <eos>
COUNTING = {"q": "<tool>", "<tool>": "count", "count": "</tool>", "</tool>": "y", "y": "<eos>"}
COUNTING["</result>"] = "<tool>"


def env_flags(tmp_path, monkeypatch, env, *extra):
    (tmp_path / "envs.py").write_text(ENVS)
    monkeypatch.chdir(tmp_path)
    argv = ["--demo", "--env", f"envs:{env}", "--output-dir", str(tmp_path / "run"), *extra]
    return config.parse_args(argv)


def test_each_completion_has_its_own_environment_and_none_outlives_its_decode_call(
    tmp_path, monkeypatch
):
    args = env_flags(tmp_path, monkeypatch, "Counter", "--max-tool-calls", "3")
    worker = Worker(1.0)
    toolbox = tools.from_flags(args, worker)
    assert list(toolbox.environment.methods) == ["count"]
    assert toolbox.environment.reward == "counted" and toolbox.specs == {}
    rows = [{"prompt": "q", "answer": "a"}, {"prompt": "q", "answer": "b", "fields": {"start": 1}}]
    for _ in range(2):  # two steps: the second sees none of the first's state
        _, _, r = rollouts_of(COUNTING, toolbox, ["q", "q"], 2, 24, rows)
        results = r.input_ids[:, r.prompt_length :][r.forced].view(4, 3, 3)[:, :, 1].tolist()
        # each completion counts its own calls: 1, 2, 3 (the second row's from 1: 2, 3, 4),
        # never another completion's, another group's or another step's
        assert results == [[ID["1"], ID["2"], ID["3"]]] * 2 + [[ID["2"], ID["3"], ID["4"]]] * 2
        assert r.tool_calls.tolist() == [3] * 4 and r.environment_rewards.tolist() == [3, 3, 4, 4]
        # none outlives the decode call in the worker (and none ever lived here)
        assert worker.call(0, (), {}, 5, "live", "envs:live") == 0
        assert tool_calls.ENVIRONMENTS == {}
    worker.close()


def test_the_environment_s_reward_is_logged_under_its_own_name_beside_the_task_s(
    tmp_path, monkeypatch
):
    args = env_flags(tmp_path, monkeypatch, "Counter")
    toolbox = tools.from_flags(args)
    env_reward = tools.environment_reward_of(toolbox)
    named = rewards.from_flags(args, [("correctness", rewards.correctness_reward)], (), env_reward)
    assert [r.name for r in named] == ["correctness", "counted"]
    task = data.Task([], [], data.as_is, named)
    total, per_fn = task.score(
        [{"prompt": "q", "answer": "7"}], ["<answer> 7 </answer>", "x"], 2,
        environment_rewards=torch.tensor([2.0, 0.0]),
    )  # fmt: skip
    assert per_fn["counted"].tolist() == [2.0, 0.0] and total.tolist() == [3.0, 0.0]
    # its name may be neither `reward` (the total's) nor another reward's
    with pytest.raises(UserError, match="no reward may be named 'reward'"):
        rewards.from_flags(args, [], (), ("reward", tools.environment_reward))
    with pytest.raises(UserError, match="same name \\(counted\\)"):
        rewards.from_flags(args, [("counted", rewards.correctness_reward)], (), env_reward)


@pytest.mark.parametrize(
    "env, message",
    [
        ("Broken", r"--env envs:Broken: reset raised ValueError: no prices for a \(envs.py:\d+\)"),
        ("Named", "no reward may be named 'reward'"),
    ],
)
def test_an_environment_that_raises_in_reset_or_misnames_its_reward_is_one_paragraph(
    tmp_path, monkeypatch, env, message
):
    args = env_flags(tmp_path, monkeypatch, env)
    with pytest.raises(UserError, match=message):
        toolbox = tools.from_flags(args)
        reward = tools.environment_reward_of(toolbox)
        rewards.from_flags(args, [], (), reward)
        _, _, r = rollouts_of(COUNTING, toolbox, rows=[{"prompt": "q", "answer": "a"}])
        raise r.tool_failure


def test_env_flags_that_cannot_work_are_refused_before_any_model_loads(tmp_path, monkeypatch):
    (tmp_path / "envs.py").write_text(ENVS)
    monkeypatch.chdir(tmp_path)
    base = ["--demo", "--output-dir", str(tmp_path / "run")]
    for extra, message in [
        (["--tool-format", "hermes"], "--tool-format hermes is how the model writes tool calls"),
        (["--env", " "], "--env ' ' names nothing"),
        (["--env", "envs:Counter", "--num-beams", "8"], "--env needs sampled completions"),
    ]:
        with pytest.raises(UserError, match=message):
            config.parse_args(base + extra)
    for spec, message in [
        ("envs", "expected MODULE:CLASS"),
        ("envs:Nope", "has no function 'Nope'"),
        ("envs:exact", "envs:exact: calculator is not a class"),
    ]:
        with pytest.raises(UserError, match=message):
            tools.from_flags(config.parse_args(base + ["--env", spec]))
    # reset's required parameters: prompt, answer or a field of the rows, said before any load
    env = tools.Environment(
        None, "envs:Shop", {}, None, ([("prices", True), ("answer", True)], False)
    )
    env.check_fields(["prices"])
    with pytest.raises(UserError, match="--env envs:Shop: reset requires 'prices'"):
        env.check_fields(["price"])


@pytest.mark.slow  # the worker imports transformers for the schemas: over a second
def test_typed_methods_in_the_hermes_format_and_a_hanging_or_leaking_environment_stop_the_run(
    tmp_path, monkeypatch
):
    args = env_flags(tmp_path, monkeypatch, "Shop", "--tool-format", "hermes")
    toolbox = tools.from_flags(args)
    assert toolbox.environment.methods["price"].schema["function"]["parameters"]["required"] == [
        "item"
    ]
    envs = tools.Environments(toolbox.environment, 5)
    envs.open([{"prompt": "q", "answer": "", "fields": {"prices": {"tea": 3}}}], 2)
    assert toolbox.run('{"name": "price", "arguments": {"item": "tea"}}', envs, 0) == ("3", None)
    assert toolbox.run('{"name": "price", "arguments": {"item": "gin"}}', envs, 1) == (
        "error: 'gin'",
        "raised",
    )
    assert envs.rewards(["", ""]).tolist() == [1.0, 1.0]
    envs.close()
    rows = [{"prompt": "q", "answer": "a"}]
    for env, message in [
        ("Slow", r"tool 'count' \(a method of --env envs:Slow\) did not return within "),
        ("Leaky", r"tool 'count' \(a method of --env envs:Leaky\) ran out of memory"),
    ]:
        args = env_flags(tmp_path, monkeypatch, env, "--tool-timeout", "1", "--reward-memory", "1")
        _, _, r = rollouts_of(COUNTING, tools.from_flags(args), rows=rows)
        assert isinstance(r.tool_failure, UserError)
        with pytest.raises(UserError, match=message):
            raise r.tool_failure


# --------------------------------------------------------------------------------------------------
# End to end: --env on the tool demo's tiny model, and an exact resume after SIGKILL.


def train_py(cwd, *argv, env=None):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "trainer.py"), *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )
    return proc.returncode, proc.stdout, proc.stderr


DEMO_ENV = ["--demo", "--env", "envs:Calc", "--eval-every", "-1", "--demo-warmup-steps", "200"]
DEMO_ENV += ["--lr-scheduler", "constant", "--batch-size", "2", "--gradient-accumulation-steps"]
DEMO_ENV += ["1", "--num-generations", "4", "--save-every", "1", "--device", "cpu"]


@pytest.mark.slow
def test_env_runs_end_to_end_and_resumes_exactly_after_a_sigkill_mid_step(tmp_path):
    """The design: a step is redone, never resumed in the middle. Environments live for one decode
    call; a checkpoint holds none (there is none to hold between steps). After a SIGKILL the step
    in progress is sampled again from its saved RNG state: the same rows reset fresh environments,
    the same tokens make the same calls, so each environment's state is rebuilt from its row and
    its completion's own calls, and the run is the uninterrupted one, bit for bit."""
    (tmp_path / "envs.py").write_text(ENVS)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    code, out, err = train_py(tmp_path, *DEMO_ENV, "--steps", "4", "--output-dir", str(straight))
    assert code == 0, err
    metrics = read_metrics(straight)
    assert len(metrics) == 4 and all("rewards/called" in m for m in metrics), metrics[0]
    assert {"rewards/correctness", "tool_calls", "tool_use"} <= set(metrics[0])
    # killed after step 2's checkpoint, in step 3's first reset (8 completions a step)
    marker = str(tmp_path / "killed-once")
    kill = {"GRPO_KILL_MARKER": marker, "GRPO_KILL_AFTER": "16"}
    code, _, err = train_py(
        tmp_path, *DEMO_ENV, "--steps", "4", "--output-dir", str(killed), env=kill
    )
    assert code == -signal.SIGKILL and os.path.exists(marker), err
    assert len(read_metrics(killed)) == 2
    code, _, err = train_py(
        tmp_path, *DEMO_ENV, "--steps", "4", "--output-dir", str(killed), "--resume", env=kill
    )
    assert code == 0, err
    assert_same_run(straight, killed)
    # an environment that raises in reset (step 2's first) stops the run: one paragraph, saved
    broken = tmp_path / "broken"
    code, _, err = train_py(
        tmp_path,
        *DEMO_ENV,
        "--steps",
        "4",
        "--output-dir",
        str(broken),
        env={"GRPO_RAISE_AFTER": "8"},
    )
    assert code == 2 and "Traceback" not in err, err
    assert "--env envs:Calc: reset raised RuntimeError: the price list is gone (envs.py:" in err
    assert "Training is saved" in err and len(read_metrics(broken)) == 1
    assert checkpoint.load_state(str(broken / "checkpoint"))["step"] == 1


# --------------------------------------------------------------------------------------------------
# Item 4's task, designed here: --task shop (data.shop_task, support/shop.py).


class LocalEnvironments:
    """tools.Environments' call, in this process: one support.shop.Shop for row 0."""

    def __init__(self, env):
        self.env = env

    def call(self, row, method, arguments, plain):
        return tool_calls.call_tool(getattr(self.env, method), arguments, plain)


def shop_tools(format_name):
    """(Tools with --task shop's environment read in this process, a Shop reset to the worked
    example's price list and basket)."""
    from support.shop import Shop

    info = tool_calls.describe_environment(Shop)
    methods = {d["schema"]["function"]["name"]: tool_calls.ToolSpec(**d) for d in info["tools"]}
    environment = tools.Environment(
        None, "support.shop:Shop", methods, info["reward"], info["reset"]
    )
    shop = Shop()
    shop.reset(prices=data.SHOP_EXAMPLE_PRICES, basket={"tea": 2, "jam": 3})
    return tools.Tools({}, format=format_name, environment=environment), shop


def test_shop_rows_hide_their_prices_in_the_environment_and_hold_out_their_items():
    train, held_out = data.shop_rows()
    assert (train, held_out) == data.shop_rows() and len(train) == 5000 and len(held_out) == 200
    seen = {item for row in train for item in row["fields"]["prices"]}
    assert seen == set(data.SHOP_ITEMS)
    assert not seen & {item for row in held_out for item in row["fields"]["prices"]}
    assert not {"tea", "jam", "figs"} & (seen | set(data.SHOP_HELD_OUT_ITEMS))  # the example's
    for row in train[:200] + held_out:
        prices, basket = row["fields"]["prices"], row["fields"]["basket"]
        assert (
            len(prices) == data.SHOP_LIST and 2 <= len(basket) <= 3 and set(basket) <= set(prices)
        )
        assert row["answer"] == str(sum(n * prices[item] for item, n in basket.items()))
        # the prompt shows the basket, never a price: its numbers are the quantities
        numbers = [int(w) for w in row["prompt"].split() if w.isdigit()]
        assert numbers == list(basket.values())
    row = train[0]
    assert row["prompt"] == "What is the total price of 3 oats and 1 oil?" and row["answer"] == "65"


@pytest.mark.parametrize("format_name", ["markers", "hermes"])
def test_the_shop_s_worked_example_is_what_its_environment_answers(format_name):
    # each call of the prompt's example, run as the decode runs it, returns the example's result:
    # the prompt teaches the environment's own answers, in each format
    toolbox, shop = shop_tools(format_name)
    assert [s.name for s in toolbox.all_specs()] == ["price", "calculator"]
    assert not toolbox.environment.methods["price"].plain
    assert toolbox.environment.methods["calculator"].plain
    fmt = tool_calls.FORMATS[format_name]
    reply = data.SHOP_EXAMPLE[format_name][1]
    position, results = 0, []
    while (start := reply.find(fmt.call_open, position)) != -1:
        end = reply.find(fmt.call_close, start)
        body = reply[start + len(fmt.call_open) : end]
        text, failed = toolbox.run(body, LocalEnvironments(shop), 0)
        assert not failed, text
        result_start = end + len(fmt.call_close)
        forced = f"{fmt.result_open}{text}{fmt.result_close}"
        assert reply[result_start : result_start + len(forced)] == forced.rstrip("\n") + (
            "\n" if format_name == "hermes" else ""
        )
        results.append(text)
        position = result_start
    assert results == ["4", "7", "29"]
    assert rewards.model_answer(reply) == "29" and shop.looked_up(reply) == 1.0
    assert rewards.model_answer_reward(
        [reply, reply.replace("<answer>29", "<answer>30")], ["29"] * 2
    ) == [1.0, 0.0]


def test_the_shop_task_s_flags_bring_its_environment_and_a_budget_for_three_items(
    tmp_path, monkeypatch
):
    for fmt in ("markers", "hermes"):
        args = config.parse_args(["--task", "shop", "--tool-format", fmt, "--output-dir", "/tmp/x"])
        assert (args.env, args.max_new_tokens, args.max_tool_calls) == ("support.shop:Shop", 256, 6)
        task = data.task_from_flags(args)
        assert task.template.args == (data.SHOP_SYSTEM_PROMPT[fmt], data.SHOP_EXAMPLE[fmt])
    # the results of the hermes format are taken out of the answer too, a model's own tags there
    # hiding its answer as in the markers format
    hermes = "<tool_response>\n<answer>5</answer>\n</tool_response>\nSo <answer>6</answer>"
    assert rewards.model_answer(hermes) == "6"
    assert rewards.model_answer("<tool_response><answer>5</answer>") is None
    with pytest.raises(UserError, match="--task shop generates its own rows"):
        config.parse_args(["--task", "shop", "--data", "x.jsonl", "--output-dir", "/tmp/x"])


def test_the_docs_name_every_new_flag():
    docs = open(os.path.join(ROOT, "docs", "tools.md")).read()
    for flag in ("--tool-format", "--env", "reward_method"):
        assert flag in docs, flag
