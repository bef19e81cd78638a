"""Tools in the loop: multi-turn GRPO, where the model calls a tool in the middle of a completion
and the tool's answer is written into it.

The protocol is one pair of markers around the call and one around the result:

    ... 123 x 45 is <tool>calculator 123*45</tool><result>5535</result> so <answer>5535</answer>
                    '-------- sampled by the model ------''---- forced ----'

The model writes <tool>NAME ARGUMENTS</tool>. Once a row of the batch has sampled the closing
marker, the tool NAME runs on ARGUMENTS (the text after the name, stripped) and
<result>TEXT</result> is forced into that row, one token per decode step, while the other rows keep
sampling (support/decode.py). Token in, token out: the sampled tokens are kept as sampled and the
result's tokens are appended, nothing is re-tokenized. A result's tokens are never scanned for
markers or EOS, so a tool returning "<tool>" or "<|im_end|>" neither calls a tool nor ends the
completion.

In the loss (trainer.py, grpo.py), forced tokens are context: attended to, but out of the loss,
out of |o_i| and every length, out of the KL and the entropy (Rollouts.completion_mask is 0 on them,
Rollouts.forced says which they are). The rewards see the whole exchange, results included, and
may ask for `tool_calls`, each completion's number of calls.

A tool is a plain function f(arguments: str) -> str, or a typed one (its schema from its type
hints and docstring: support/tool_calls.py), or a public method of an --env class, one instance per
completion. The built-in `calculator` (support/calculator.py) runs in this process; --tool
MODULE:FUNCTION and --env MODULE:CLASS run in the run's worker process (support/worker.py), as
--reward-fn does, within --tool-timeout per call. A call that cannot run (an unknown name,
malformed JSON, arguments its schema refuses) or a tool that raises returns "error: ..." as the
result, which the model reads and the metrics count; one that hangs, dies or runs out of memory
stops the run with an error naming it, training saved. --tool-format hermes writes the calls as
Qwen's <tool_call>{"name": ..., "arguments": {...}}</tool_call>, the results as
<tool_response>...</tool_response>, and the tools' schemas into the prompt (ToolPrompt).
"""

import functools
import itertools
import os
import re
import weakref
from dataclasses import dataclass, field

import torch

from support import tool_calls
from support.calculator import calculator
from support.errors import UserError
from support.tool_calls import FORMATS, CallError, ToolSpec

CALL_OPEN, CALL_CLOSE = "<tool>", "</tool>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"

# A result up to this many characters per --max-tool-result-tokens token is tokenized whole; a
# longer one is cut first (ToolSession.result_chars).
SHORT_RESULT_CHARS_PER_TOKEN = 16

# --tool's built-ins, run in this process (they are bounded: no hang, no runaway memory)
BUILTIN_TOOLS = {"calculator": calculator}


@dataclass(frozen=True)
class Tools:
    """The tools a run's completions may call, and the limits on them."""

    functions: dict  # name -> f (a built-in, or a worker.Remote): --tool's
    timeout: float = 30.0  # --tool-timeout: seconds one call in the worker may take
    max_calls: int = 4  # --max-tool-calls per completion; later calls are left as plain text
    max_result_tokens: int = 64  # --max-tool-result-tokens: a result's text is cut to this
    format: str = "markers"  # --tool-format: how a call is written (tool_calls.FORMATS)
    # name -> ToolSpec of each function (its schema; whether it is plain). Filled in for a
    # function given without one (a built-in, a test's lambda) by reading it here.
    specs: dict = field(default_factory=dict)
    environment: "Environment | None" = None  # --env: its methods are each completion's tools
    response_prefix: str = ""  # --response-prefix: before each completion the reward reads

    def __post_init__(self):
        for name, fn in self.functions.items():
            if name not in self.specs:
                self.specs[name] = describe(fn, name)

    def all_specs(self):
        """[ToolSpec] of every tool, --tool's then the environment's: what the prompt lists."""
        methods = [] if self.environment is None else list(self.environment.methods.values())
        return [*self.specs.values(), *methods]

    def run(self, body, environments=None, row=0):
        """The result text of one call in completion `row` (whose environment is in
        `environments`, an Environments, if the run has one), `body` being what stood between
        the call markers: (text, what went wrong: None, "malformed" or "raised"). A call that
        cannot run ("malformed": an unknown name, malformed JSON, arguments its schema refuses)
        or a tool that raises ("raised") gives "error: ..."; a tool that hangs, dies, runs out of
        memory or returns what is not text is a UserError (the run stops, saved)."""
        try:
            name, arguments = tool_calls.parse_call(body, self.format)
            spec = self.spec(name, environments)
            arguments = call_arguments(spec, arguments, self.format)
        except CallError as e:
            return f"error: {e}", "malformed"
        if name in self.functions:
            what = f"tool {name!r} ({getattr(self.functions[name], 'spec', 'built in')})"
        else:
            what = f"tool {name!r} (a method of --env {self.environment.spec})"
        try:
            if name in self.functions:
                result = self.call(self.functions[name], spec, arguments)
            else:  # a method of this completion's environment, in the worker
                result = environments.call(row, name, arguments, spec.plain)
        except UserError:  # the worker's own verdict on user code: the run stops
            raise
        except Exception as e:
            failed = tool_failure(what, e, self.timeout)
            if failed is not None:
                raise failed from None
            return f"error: {e}", "raised"
        if not isinstance(result, str):
            raise UserError(
                f"{what} returned a {type(result).__name__}, not a string: a tool is a function "
                "f(arguments: str) -> str. Training is saved in the output directory."
            )
        return result, None

    def call(self, fn, spec, arguments):
        """One --tool function called: in the worker within --tool-timeout (a worker.Remote),
        else here."""
        if hasattr(fn, "worker") and spec.plain:
            return fn.call((arguments,), {}, self.timeout)
        if hasattr(fn, "worker"):
            return fn.call((arguments, False), {}, self.timeout, "support.tool_calls:call_tool")
        return fn(arguments) if spec.plain else tool_calls.call_tool(fn, arguments, False)

    def spec(self, name, environments):
        """The ToolSpec of the tool `name`, or CallError naming the tools there are."""
        spec = self.specs.get(name)
        if spec is None and environments is not None:
            spec = self.environment.methods.get(name)
        if spec is None:
            names = [s.name for s in self.all_specs()]
            raise CallError(f"no tool named {name!r} (tools: {', '.join(names)})")
        return spec

    def session(self, tokenizer, rows, budget, data_rows=None):
        """The state of one decode call of `rows` rows with `budget` completion tokens each;
        `data_rows`: the B rows they answer (G each, in order), which reset the environments."""
        return ToolSession(self, tokenizer, rows, budget, data_rows)

    def check_fields(self, fields):
        """UserError where the environment's reset requires a field the rows do not have (said
        before any model loads, not at the first step)."""
        if self.environment is not None:
            self.environment.check_fields(fields)


def call_arguments(spec, arguments, format_name):
    """What the tool is called with: the text for a plain tool, a dict for a typed one, checked
    against its schema first (a CallError where they do not fit). In the markers format a plain
    tool takes the text after its name as it is, and a typed one a JSON object there; in the
    hermes format both take the call's "arguments" object, a plain tool's holding its one
    parameter."""
    if format_name == "markers" and spec.plain:
        return arguments
    if format_name == "markers":
        arguments = tool_calls.parse_markers_arguments(arguments)
    tool_calls.check_arguments(spec, arguments)
    return next(iter(arguments.values())) if spec.plain else arguments


def describe(fn, name):
    """The ToolSpec of function `fn` named `name`: read in the worker for a worker.Remote, else
    here."""
    if hasattr(fn, "worker"):
        adapter = "support.tool_calls:describe_tool"
        return ToolSpec(**fn.call((name,), {}, 0, adapter))
    return ToolSpec(**tool_calls.describe_tool(fn, name))


def tool_failure(what, error, timeout):
    """The UserError for a tool call that failed as a process (timed out, died, ran out of
    memory), or None for an error the tool raised (which becomes its result text). `what` names
    the tool: "tool 'search' (my_tools:search)"."""
    from support.worker import RemoteError, WorkerFailed, WorkerTimeout

    if isinstance(error, WorkerTimeout):
        return UserError(
            f"{what} did not return within --tool-timeout {timeout:g} s and was stopped. "
            "Training is saved in the output directory; make the tool faster or raise "
            "--tool-timeout, then --resume."
        )
    if isinstance(error, WorkerFailed):
        return UserError(
            f"{what} {error}. Training is saved in the output directory; fix the tool, then "
            "--resume."
        )
    if isinstance(error, RemoteError) and error.type_name == "MemoryError":
        return UserError(
            f"{what} ran out of memory in the worker process{error.where} (--reward-memory caps "
            "its address space, for tools, environments and reward functions alike). Training is "
            "saved in the output directory; fix the leak or raise --reward-memory, then --resume."
        )
    return None


class ToolSession:
    """One decode call's tool calls: which rows have result tokens still to force, what each row
    sampled since its last result (where its next call is looked for), and each row's calls,
    errors (and of those, malformed calls) and forced positions, and the rows' environments
    (--env), built before the decode and dropped after it. support/decode.lean_decode calls
    force() then observe() at every step; sampling.sample_rollouts calls finish() (the
    environments' rewards) and close()."""

    def __init__(self, tools, tokenizer, rows, budget, data_rows=None):
        self.tools, self.tokenizer, self.budget = tools, tokenizer, budget
        self.queue = [[] for _ in range(rows)]  # result tokens still to force, per row
        self.segment = [[] for _ in range(rows)]  # tokens sampled since the row's last result
        self.calls, self.errors, self.malformed = [0] * rows, [0] * rows, [0] * rows
        self.forced = torch.zeros(rows, budget, dtype=torch.bool)  # [rows, budget] on the CPU
        self.format = FORMATS[tools.format]
        self.last_char = self.format.call_close[-1]
        self.may_close = {}  # token id -> whether its text holds the close marker's last character
        self.failure = None  # a UserError a tool raised: no more calls, re-raised after decoding
        self.environments = None  # one per row, in the worker (Environments)
        if tools.environment is not None:
            self.environments = Environments(tools.environment, tools.timeout)
            try:
                self.environments.open(data_rows, rows)
            except UserError as e:  # reset raised or hung: no call runs, the run stops after
                self.failure = e

    def force(self, rows, token, t):
        """The step's tokens: row rows[i] takes the next token of its queue, if it has one, instead
        of token[i] (sampled). Returns (tokens, [len(rows)] bool: forced, or None when none was)."""
        ids = rows.tolist()
        pending = [i for i, r in enumerate(ids) if r < len(self.queue) and self.queue[r]]
        if not pending:
            return token, None
        forced = [self.queue[ids[i]].pop(0) for i in pending]
        token = token.clone()
        token[pending] = torch.tensor(forced, dtype=token.dtype, device=token.device)
        which = torch.zeros(len(ids), dtype=torch.bool)
        which[pending] = True
        self.forced[[ids[i] for i in pending], t] = True
        return token, which.to(token.device)

    def observe(self, rows, token, forced, done, t):
        """After step t wrote `token`: each live row that sampled (was not forced, not done) adds
        its token to its segment; a segment that now holds the close marker after an open one is a
        call, run now, its result queued for the next steps (cut to what the budget has left)."""
        ids, tokens = rows.tolist(), token.tolist()
        skip = done if forced is None else done | forced
        skip = skip.tolist()
        calls = []
        for i, (r, tok) in enumerate(zip(ids, tokens)):
            if r >= len(self.queue) or skip[i]:
                continue
            self.segment[r].append(tok)
            if self.calls[r] >= self.tools.max_calls or not self.closes(tok):
                continue
            text = self.tokenizer.decode(self.segment[r])
            call_open, call_close = self.format.call_open, self.format.call_close
            end = text.find(call_close)
            if end < 0:
                continue
            start = text.rfind(call_open, 0, end)
            self.segment[r] = []  # the next call is looked for after this one
            if start >= 0:
                calls.append((r, text[start + len(call_open) : end]))
        for r, body in calls:
            if self.failure is not None:
                break
            try:
                result, error = self.tools.run(body, self.environments, r)
            except UserError as e:  # re-raised by sampling.sample_rollouts, on every rank alike
                self.failure = e
                break
            self.calls[r] += 1
            self.errors[r] += error is not None
            self.malformed[r] += error == "malformed"
            self.queue[r] = self.result_tokens(result)[: self.budget - t - 1]

    def closes(self, tok):
        """Whether token `tok`'s text may end a close marker (it holds the marker's last
        character)."""
        if tok not in self.may_close:
            self.may_close[tok] = self.last_char in self.tokenizer.decode([tok])
        return self.may_close[tok]

    def result_tokens(self, text):
        """<result>TEXT</result> as token ids, TEXT cut to max_result_tokens tokens. Special-token
        text in TEXT ("<|im_end|>") stays text: it is split like any other. A long TEXT is cut to
        result_chars() characters first: a 10 MB result costs what a short one does, not minutes
        of tokenizing what is then thrown away."""

        def encode(piece, split=True):
            return self.tokenizer(piece, add_special_tokens=False, split_special_tokens=split)[
                "input_ids"
            ]

        n = self.tools.max_result_tokens
        if len(text) > SHORT_RESULT_CHARS_PER_TOKEN * n:  # else tokenizing it all is cheap anyway
            text = text[: self.result_chars()]
        inner = encode(text)[:n]
        return (
            encode(self.format.result_open, False) + inner + encode(self.format.result_close, False)
        )

    def finish(self, texts):
        """[rows] the environments' rewards of the finished completions (`texts`, decoded: the
        response prefix goes before each, as the rewards read them), or None without an
        environment reward (or after a failure, which the caller raises)."""
        reward = None if self.tools.environment is None else self.tools.environment.reward
        if reward is None or self.failure is not None:
            return None
        try:
            return self.environments.rewards([self.tools.response_prefix + t for t in texts])
        except UserError as e:
            self.failure = e
            return None

    def close(self):
        """Drop the rows' environments in the worker (nothing without any)."""
        if self.environments is not None:
            self.environments.close()

    def result_chars(self):
        """How many characters of a result can reach its first max_result_tokens tokens, with room
        to spare: each token covers at most the longest token's text in the vocabulary (a
        byte-level token's string has one character per byte, so at least as many as its text),
        and the bound is twice that for one token more, so that the pieces a pre-tokenizer or a
        merge joins across the cut lie far beyond the tokens kept. (Characters that make no token
        at all, a run of whitespace that a word-level tokenizer drops, count as characters: a
        result of megabytes of blanks is cut within them.)"""
        return 2 * (self.tools.max_result_tokens + 1) * longest_token(self.tokenizer)


# The longest token's text of each tokenizer in use (ToolSession.result_chars), computed once:
# reading a 49k-token vocabulary takes about 0.1 s.
LONGEST_TOKEN = weakref.WeakKeyDictionary()


def longest_token(tokenizer):
    """The most characters of any token's string in `tokenizer`'s vocabulary (at least 1)."""
    try:
        return LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):  # not seen yet, or a tokenizer that cannot be a key
        longest = max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))
    try:
        LONGEST_TOKEN[tokenizer] = longest
    except TypeError:
        pass
    return longest


def from_flags(args, worker=None):
    """The run's Tools from --tool (built-in names or MODULE:FUNCTION, loaded in `worker` like
    --reward-fn), --env (MODULE:CLASS, loaded there too), --tool-format, --tool-timeout,
    --max-tool-calls, --max-tool-result-tokens and --response-prefix; None without --tool or
    --env."""
    if not args.tool and not args.env:
        return None
    from support.worker import Worker

    functions, specs = {}, {}
    for spec in args.tool:
        if spec in BUILTIN_TOOLS:
            name, fn = spec, BUILTIN_TOOLS[spec]
        else:
            worker = worker or Worker(args.reward_memory)
            example = "my_tools:search for the function search in ./my_tools.py"
            name, fn = load(spec, "--tool", worker, "FUNCTION", example)
        if name in functions:
            raise UserError(f"--tool: two tools are named {name!r}; each name may be given once.")
        functions[name] = fn
        specs[name] = described(spec, "--tool", lambda: describe(fn, name))
    environment = None
    if args.env:
        worker = worker or Worker(args.reward_memory)
        environment = load_environment(args.env, worker, args.reward_timeout)
        clash = sorted(set(functions) & set(environment.methods))
        if clash:
            raise UserError(
                f"--tool and --env {args.env} both have a tool named {clash[0]!r}: the model calls "
                "a tool by its name, so each name may be given once."
            )
    return Tools(
        functions,
        args.tool_timeout,
        args.max_tool_calls,
        args.max_tool_result_tokens,
        args.tool_format,
        specs,
        environment,
        args.response_prefix,
    )


def load(spec, flag, worker, what, example):
    """(name, worker.Remote) of a --tool MODULE:FUNCTION or --env MODULE:CLASS, imported in the
    worker; a UserError for what goes wrong."""
    from support.worker import WorkerFailed

    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        builtins = f" or a built-in: {', '.join(BUILTIN_TOOLS)}" if flag == "--tool" else ""
        raise UserError(f"{flag} {spec!r}: expected MODULE:{what} (e.g. {example}){builtins}.")
    try:
        return name, worker.load(spec, flag, os.getcwd())
    except WorkerFailed as e:
        raise UserError(f"{flag} {spec}: importing {module_name}: {e}.") from None


def described(spec, flag, describe_it):
    """describe_it()'s value, a UserError naming the flag and spec where it fails."""
    from support.worker import RemoteError, WorkerFailed

    try:
        return describe_it()
    except UserError as e:
        raise UserError(f"{flag} {spec}: {str(e).rstrip('.')}.") from None
    except (WorkerFailed, RemoteError) as e:
        raise UserError(f"{flag} {spec}: reading it in the worker process failed: {e}.") from None


@dataclass(frozen=True)
class Environment:
    """--env MODULE:CLASS as the trainer holds it: the class, loaded in the worker process, and
    what tool_calls.describe_environment read of it there."""

    cls: object  # a worker.Remote: the class, built there once per completion
    spec: str  # MODULE:CLASS, for the messages
    methods: dict  # name -> ToolSpec: its public methods, each completion's tools
    reward: str | None  # its reward_method's name, which the reward is logged under; None: none
    reset: tuple | None  # ([(parameter, required)], takes **kwargs) of reset; None: no reset
    reward_timeout: float = 600.0  # --reward-timeout: the reward method on one call's completions

    def reset_fields(self, row):
        """What reset(**...) gets for a data row: its prompt, answer and other fields, those it
        declares (all of them if it takes **kwargs)."""
        if self.reset is None:
            return {}
        fields = {"prompt": row["prompt"], "answer": row["answer"], **row.get("fields", {})}
        names, takes_all = self.reset
        return fields if takes_all else {n: fields[n] for n, _ in names if n in fields}

    def check_fields(self, fields):
        """UserError where reset requires a parameter that is neither prompt, answer nor a field
        of the rows."""
        have = {"prompt", "answer", *fields}
        missing = [
            n for n, required in (self.reset or ([], False))[0] if required and n not in have
        ]
        if missing:
            raise UserError(
                f"--env {self.spec}: reset requires {missing[0]!r}, which is neither prompt, answer "
                f"nor a field of the data rows (fields: {', '.join(sorted(fields)) or 'none'})."
            )


def load_environment(spec, worker, reward_timeout):
    """--env MODULE:CLASS's Environment: the class imported in `worker`, its tools read there."""
    _, cls = load(spec, "--env", worker, "CLASS", "shop:Shop for the class Shop in ./shop.py")
    adapter = "support.tool_calls:describe_environment"
    info = described(spec, "--env", lambda: cls.call((), {}, 0, adapter))
    methods = {d["schema"]["function"]["name"]: ToolSpec(**d) for d in info["tools"]}
    return Environment(cls, spec, methods, info["reward"], info["reset"], reward_timeout)


class Environments:
    """One decode call's environments, in the worker process: one instance per completion, row r
    of the call's B*G built and reset with data row r // G's fields before the decode, and
    dropped after it. Another completion, group, step or evaluation never sees one's state."""

    sessions = itertools.count()  # each decode call's number: its instances' key in the worker

    def __init__(self, environment, timeout):
        self.environment, self.timeout = environment, timeout
        self.session, self.opened = next(Environments.sessions), False

    def request(self, adapter, args, timeout):
        cls = self.environment.cls
        return cls.call((self.session, *args), {}, timeout, f"support.tool_calls:{adapter}")

    def open(self, data_rows, n):
        """Build and reset the n environments, each within --tool-timeout."""
        self.opened = True
        G = n // len(data_rows)
        for r in range(n):
            fields = self.environment.reset_fields(data_rows[r // G])
            try:
                self.request("env_reset", (r, fields), self.timeout)
            except Exception as e:  # noqa: BLE001 (each a stop, said as what it was)
                raise self.failure("reset", e, self.timeout, "--tool-timeout", fields) from None

    def call(self, row, method, arguments, plain):
        """One tool call of completion `row`'s environment (Tools.run says what its failures
        are)."""
        return self.request("env_call", (row, method, arguments, plain), self.timeout)

    def rewards(self, completions):
        """[rows] float32 tensor: each environment's reward method on its completion."""
        timeout, method = self.environment.reward_timeout, self.environment.reward
        try:
            values = self.request("env_rewards", (method, completions), timeout)
        except Exception as e:  # noqa: BLE001
            raise self.failure(
                f"its reward method {method}", e, timeout, "--reward-timeout"
            ) from None
        return torch.tensor(values, dtype=torch.float32)

    def close(self):
        """Drop the call's environments in the worker; nothing where the worker has stopped (a
        failure ended it: they went with it)."""
        worker = self.environment.cls.worker
        if not self.opened or worker.process is None or worker.process.poll() is not None:
            return
        from support.worker import RemoteError, WorkerFailed

        try:
            self.request("env_close", (), self.timeout)
        except (WorkerFailed, RemoteError):  # it ended the worker: nothing is left to drop
            pass

    def failure(self, what, error, timeout, flag, fields=None):
        """The UserError that stops the run when an environment's reset or reward method fails:
        raised, hung, died or out of memory; one paragraph naming it."""
        from support.worker import RemoteError, WorkerTimeout

        name = f"--env {self.environment.spec}: {what}"
        row = "" if fields is None else f" (the row's fields: {str(fields)[:200]})"
        if isinstance(error, UserError):
            message = f"{name}: {error}"
        elif isinstance(error, WorkerTimeout):
            message = f"{name} did not return within {flag} {timeout:g} s and was stopped{row}"
        elif isinstance(error, RemoteError) and error.type_name == "MemoryError":
            message = (
                f"{name} ran out of memory in the worker process{error.where} (--reward-memory "
                "caps its address space, environments included)"
            )
        elif isinstance(error, RemoteError):
            message = f"{name} raised {error.type_name}: {error}{error.where}{row}"
        else:
            message = f"{name} {error}{row}"
        return UserError(
            f"{message}. Training is saved in the output directory; fix the environment, then "
            "--resume."
        )


def environment_reward(completions, answers, environment_rewards):
    """The --env reward method's values as a reward function returns them: computed with the
    decode, while each completion's environment lived (ToolSession.finish), and passed in by
    data.Task.score."""
    return [float(v) for v in environment_rewards]


def environment_reward_of(toolbox):
    """(name, environment_reward) of the run's --env reward method, or None."""
    environment = None if toolbox is None else toolbox.environment
    if environment is None or environment.reward is None:
        return None
    return environment.reward, environment_reward


def prompt_template(template, toolbox):
    """A task's template, with the tools listed in its prompt under --tool-format hermes
    (ToolPrompt); as it is otherwise (the markers format's prompt is the task's own)."""
    if toolbox is None or toolbox.format != "hermes":
        return template
    return ToolPrompt(template, toolbox.all_specs(), toolbox.format)


class ToolPrompt:
    """--tool-format hermes: a task's template with the tools in its prompt. Through the
    tokenizer's chat template, as tools= (the schemas), where the template reads `tools`; else as
    tool_calls.tools_text in the system message (a template without tools: SmolLM2's), or before
    the prompt (no chat template). Never tools=[] (TRL PR #5346): a run without tools has no
    ToolPrompt, and tools_text refuses an empty list."""

    def __init__(self, template, specs, format_name):
        self.template, self.specs, self.format = template, list(specs), format_name
        self.text = tool_calls.tools_text(self.specs, format_name)

    def __call__(self, tokenizer, text):
        if getattr(tokenizer, "chat_template", None) is None:
            prompt = self.template(tokenizer, text)
            bos = getattr(tokenizer, "bos_token", None) or ""
            head = bos if prompt.startswith(bos) else ""
            return f"{head}{self.text}\n\n{prompt[len(head) :]}"
        return self.template(WithTools(tokenizer, self), text)

    def chat(self, tokenizer, conversation, **kwargs):
        """apply_chat_template of the conversation, the tools in it."""
        if template_reads_tools(tokenizer.chat_template):
            schemas = [spec.schema for spec in self.specs]
            return tokenizer.apply_chat_template(conversation, tools=schemas, **kwargs)
        return tokenizer.apply_chat_template(with_system_text(conversation, self.text), **kwargs)


class WithTools:
    """A tokenizer as a task's template sees it under ToolPrompt: its apply_chat_template puts
    the tools in; everything else is the tokenizer's own."""

    def __init__(self, tokenizer, prompt):
        self.tokenizer, self.prompt = tokenizer, prompt

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def apply_chat_template(self, conversation, **kwargs):
        return self.prompt.chat(self.tokenizer, conversation, **kwargs)


def with_system_text(conversation, text):
    """The conversation with `text` at the end of its system message (one put first if none)."""
    if conversation and conversation[0]["role"] == "system":
        content = conversation[0]["content"]
        first = dict(conversation[0], content=f"{content}\n\n{text}" if content else text)
        return [first, *conversation[1:]]
    return [{"role": "system", "content": text}, *conversation]


@functools.lru_cache(maxsize=16)
def template_reads_tools(chat_template):
    """Whether a chat template reads the variable `tools` (takes tools=): read off the template's
    own syntax tree (jinja2.meta), never by comparing it with known templates, so a fork, an
    edited copy or a template of your own is read as it is (TRL PR #5833)."""
    import jinja2
    import jinja2.ext
    import jinja2.meta

    if not isinstance(chat_template, str):
        return False
    try:
        tree = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(chat_template)
    except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %}): by name
        return re.search(r"\btools\b", chat_template) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(tree)
