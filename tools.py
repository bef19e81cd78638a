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

A tool is a plain function f(arguments: str) -> str. The built-in `calculator`
(support/calculator.py) runs in this process; --tool MODULE:FUNCTION runs in the run's worker
process (support/worker.py), as --reward-fn does, within --tool-timeout per call. A tool that
raises returns its error as the result ("error: ..."), which the model reads and the metrics count;
one that hangs, dies or runs out of memory stops the run with an error naming it, training saved.
"""

import os
import weakref
from dataclasses import dataclass

import torch

from support.calculator import calculator
from support.errors import UserError

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

    functions: dict  # name -> f(arguments: str) -> str (a built-in, or a worker.Remote)
    timeout: float = 30.0  # --tool-timeout: seconds one call of a --tool MODULE:FUNCTION may take
    max_calls: int = 4  # --max-tool-calls per completion; later calls are left as plain text
    max_result_tokens: int = 64  # --max-tool-result-tokens: a result's text is cut to this

    def run(self, body):
        """The result text of one call, `body` being what stood between the call markers: (text,
        whether it is an error). An unknown tool, or one that raises, gives "error: ..."; a tool
        that hangs, dies or returns a non-string is a UserError (the run stops, saved)."""
        name, _, arguments = body.strip().partition(" ")
        fn = self.functions.get(name)
        if fn is None:
            return f"error: no tool named {name!r} (tools: {', '.join(self.functions)})", True
        try:
            if hasattr(fn, "worker"):  # a worker.Remote: in the worker, within the time limit
                result = fn.call((arguments.strip(),), {}, self.timeout)
            else:
                result = fn(arguments.strip())
        except UserError:  # the worker's own verdict on user code: the run stops
            raise
        except Exception as e:
            failed = tool_failure(name, fn, e, self.timeout)
            if failed is not None:
                raise failed from None
            return f"error: {e}", True
        if not isinstance(result, str):
            raise UserError(
                f"tool {name!r} returned a {type(result).__name__}, not a string: a tool is a function "
                "f(arguments: str) -> str. Training is saved in the output directory."
            )
        return result, False

    def session(self, tokenizer, rows, budget):
        """The state of one decode call of `rows` rows with `budget` completion tokens each."""
        return ToolSession(self, tokenizer, rows, budget)


def tool_failure(name, fn, error, timeout):
    """The UserError for a tool call that failed as a process (timed out, died), or None for an
    error the tool raised (which becomes its result text)."""
    from support.worker import WorkerFailed, WorkerTimeout

    if isinstance(error, WorkerTimeout):
        return UserError(
            f"tool {name!r} ({fn.spec}) did not return within --tool-timeout {timeout:g} s and was "
            "stopped. Training is saved in the output directory; make the tool faster or raise "
            "--tool-timeout, then --resume."
        )
    if isinstance(error, WorkerFailed):
        return UserError(
            f"tool {name!r} ({fn.spec}) {error}. Training is saved in the output directory; fix the "
            "tool, then --resume."
        )
    return None


class ToolSession:
    """One decode call's tool calls: which rows have result tokens still to force, what each row
    sampled since its last result (where its next call is looked for), and each row's calls,
    errors and forced positions. support/decode.lean_decode calls force() then observe() at every
    step."""

    def __init__(self, tools, tokenizer, rows, budget):
        self.tools, self.tokenizer, self.budget = tools, tokenizer, budget
        self.queue = [[] for _ in range(rows)]  # result tokens still to force, per row
        self.segment = [[] for _ in range(rows)]  # tokens sampled since the row's last result
        self.calls, self.errors = [0] * rows, [0] * rows
        self.forced = torch.zeros(rows, budget, dtype=torch.bool)  # [rows, budget] on the CPU
        self.last_char = CALL_CLOSE[-1]
        self.may_close = {}  # token id -> whether its text holds the close marker's last character
        self.failure = None  # a UserError a tool raised: no more calls, re-raised after decoding

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
            end = text.find(CALL_CLOSE)
            if end < 0:
                continue
            start = text.rfind(CALL_OPEN, 0, end)
            self.segment[r] = []  # the next call is looked for after this one
            if start >= 0:
                calls.append((r, text[start + len(CALL_OPEN) : end]))
        for r, body in calls:
            if self.failure is not None:
                break
            try:
                result, error = self.tools.run(body)
            except UserError as e:  # re-raised by sampling.sample_rollouts, on every rank alike
                self.failure = e
                break
            self.calls[r] += 1
            self.errors[r] += int(error)
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
        return encode(RESULT_OPEN, False) + inner + encode(RESULT_CLOSE, False)

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
    --reward-fn), --tool-timeout, --max-tool-calls and --max-tool-result-tokens; None without
    --tool."""
    if not args.tool:
        return None
    from support.worker import Worker, WorkerFailed

    functions = {}
    for spec in args.tool:
        if spec in BUILTIN_TOOLS:
            name, fn = spec, BUILTIN_TOOLS[spec]
        else:
            module_name, _, name = spec.partition(":")
            if not module_name or not name:
                raise UserError(
                    f"--tool {spec!r}: expected MODULE:FUNCTION (e.g. my_tools:search for the function "
                    f"search in ./my_tools.py) or a built-in: {', '.join(BUILTIN_TOOLS)}."
                )
            worker = worker or Worker(args.reward_memory)
            try:
                fn = worker.load(spec, "--tool", os.getcwd())
            except WorkerFailed as e:
                raise UserError(f"--tool {spec}: importing {module_name}: {e}.") from None
        if name in functions:
            raise UserError(f"--tool: two tools are named {name!r}; each name may be given once.")
        functions[name] = fn
    return Tools(functions, args.tool_timeout, args.max_tool_calls, args.max_tool_result_tokens)
