"""Evaluation on held-out questions: each reward's mean over k samples per question, pass@k and
maj@k (DeepSeekMath §5.2.2) and the mean's noise over evaluation seeds (draw_noise), in its own
RNG stream, shared out over the ranks under torchrun.
"""

import collections
import time
from dataclasses import dataclass

import torch

import sampling
from support import decode, distributed, report
from support.errors import UserError
from support.worker import WorkerFailed, WorkerTimeout


@dataclass(frozen=True)
class EvalSettings:
    """evaluate()'s settings, from the --eval-* flags (EvalSettings.of)."""

    sampling: sampling.Sampling  # --eval-temperature (0: greedy), the training run's top-k/top-p
    samples: int  # k completions per question
    limit: int | None  # the first `limit` held-out questions; None: all
    batch_size: int  # questions per generate call
    seed: int  # the evaluation's own RNG seed: --eval-seed, else --seed

    @classmethod
    def of(cls, args):
        return cls(
            sampling.Sampling(
                args.eval_temperature,
                args.top_k,
                args.top_p,
                args.max_new_tokens,
                args.max_prompt_length,
                graphs=args.decode == "graphs",
                fused=args.decode == "fused",
            ),
            args.eval_samples,
            args.eval_limit,
            args.eval_batch_size,
            args.seed if args.eval_seed is None else args.eval_seed,
        )


def evaluate_with(model, tokenizer, task, settings, autocast_dtype=None):
    """evaluate() with EvalSettings, in the autocast dtype `autocast_dtype`."""
    s = settings
    return evaluate(
        model, tokenizer, task, s.sampling, s.samples, s.limit, s.batch_size, s.seed, autocast_dtype
    )


def evaluate(
    model, tokenizer, task, settings, samples, limit=None, batch_size=8, seed=0, autocast_dtype=None
):
    """On the first `limit` held-out questions, `samples` (k) completions each: the mean of each
    reward function and of the weighted total ("reward") over all completions, and with k > 1
    each one's pass@k: a question's best of its k rewards, averaged over questions (for a 0/1
    reward such as correctness, the fraction solved at least once). Runs under its own RNG seeded
    with `seed`, so it neither perturbs nor depends on the training RNG stream. Under torchrun
    each rank takes every world-th question (its RNG seeded with seed + rank) and the tables are
    gathered."""
    every, chunks, t0 = task.eval[:limit], [], time.time()
    rows = every[distributed.rank() :: distributed.world()]
    if (
        len(rows) > batch_size and distributed.is_main()
    ):  # a long one says so before its first batch
        print(f"  eval: {len(every)} questions x {samples} samples ...", flush=True)
    device = next(model.parameters()).device
    with torch.random.fork_rng(
        devices=[torch.cuda.current_device()] if device.type == "cuda" else []
    ):
        torch.manual_seed(seed + distributed.rank())
        # as many calls on every rank
        for i in range(0, -(-len(every) // distributed.world()), batch_size):
            chunk = rows[i : i + batch_size]
            if not chunk and not decode.is_sharded(model):
                break
            # FSDP2: join in
            asked = chunk or every[:1]
            prompts = [task.prompt(tokenizer, row["prompt"]) for row in asked]
            rollouts = sampling.sample_rollouts(
                model, tokenizer, prompts, settings, samples, autocast_dtype, task.tools, asked
            )
            if rollouts.tool_failure is not None:
                raise rollouts.tool_failure
            if chunk:
                env = rollouts.environment_rewards  # --env's reward method: a column of its own
                total, per_fn = task.score(
                    chunk,
                    rollouts.texts,
                    samples,
                    rollouts.lengths,
                    rollouts.tool_calls,
                    **({} if env is None else {"environment_rewards": env}),
                )
                chunks.append({**per_fn, "reward": total})
                if task.tools is not None:  # means only: no pass@k or maj@k of these
                    chunks[-1].update(
                        report.tool_columns(
                            rollouts.tool_calls, rollouts.tool_errors, rollouts.tool_malformed
                        )
                    )
                if task.extract_answer is not None and samples > 1:
                    # each question's representative completion for maj@k: [questions]
                    chunks[-1][MAJORITY] = majority_choices(
                        task, task.responses(rollouts.texts), samples
                    )
            if (
                len(rows) > batch_size and distributed.is_main()
            ):  # a progress line per generate call
                report.print_eval_progress(i + len(chunk), len(rows), time.time() - t0)
    # every rank's
    chunks = [
        c
        for part in distributed.gather_objects([{k: v.cpu() for k, v in c.items()} for c in chunks])
        for c in part
    ]
    if not chunks:
        return {}  # no questions
    # [Q, k]
    table = {
        name: torch.cat([c[name] for c in chunks]).view(len(every), samples) for name in chunks[0]
    }
    choice = table.pop(MAJORITY, None)  # [Q, k]: each row its index k times
    result = {name: table.pop(name).mean().item() for name in report.TOOL_COLUMNS if name in table}
    result.update({name: r.mean().item() for name, r in table.items()})
    if samples > 1:
        result.update(
            {f"{name}_pass@{samples}": r.max(1).values.mean().item() for name, r in table.items()}
        )
        result.update({f"{name}_noise": draw_noise(r) for name, r in table.items()})
    if choice is not None:
        result.update(
            {
                f"{name}_maj@{samples}": r.gather(1, choice[:, :1]).mean().item()
                for name, r in table.items()
            }
        )
    return result


MAJORITY = "__majority__"  # evaluate's table: each question's maj@k completion


def draw_noise(table):
    """The eval noise of a mean over [Q, k] rewards (k > 1 samples of each of Q questions),
    estimated from this one evaluation: the std that the mean has over evaluation seeds, the same
    questions sampled again. Each question's k draws are independent given the model, so the mean's
    variance is the sum over questions of each question's variance over k, divided by Q², and
    each question's variance is estimated without bias from its own k draws (Bessel's k - 1)."""
    Q, k = table.shape
    return (table.double().var(1).sum() / k).sqrt().item() / Q


def majority_choices(task, responses, k):
    """For each question (k responses each, in order): the index of the response that stands for
    the answer most of them give (maj@k, DeepSeekMath §5.2.2): [questions * k] long, each
    question's index k times. Answers come from task.extract_answer; a response without one
    (None) does not vote. A tie goes to the answer given first; a question where no response
    gives an answer is represented by its first response. maj@k of a reward is then that
    response's reward."""
    answers = [answer_of(task.extract_answer, r) for r in responses]
    # k copies per question, as the rewards are laid out
    return torch.tensor(
        [majority_index(answers[i : i + k]) for i in range(0, len(answers), k)]
    ).repeat_interleave(k)


def majority_index(answers):
    """The index of the first of `answers` (strings or None) that is the most frequent non-None
    answer: ["7", None, "8", "8", "7"] -> 0 (7 and 8 tie at two, 7 came first); [None, None] ->
    0."""
    counts = collections.Counter(a for a in answers if a is not None)
    if not counts:
        return 0
    # a Counter keeps the order answers were first given, and max the first of equals
    return answers.index(max(counts, key=counts.get))


def answer_of(fn, response):
    """fn(response) as a string, or None; a function that raises is the user's error, said in one
    line."""
    try:
        answer = fn(response)
    except WorkerTimeout:
        raise UserError(
            f"--extract-answer {fn.spec} did not return within {fn.timeout:g} s (--reward-timeout) "
            f"on the completion {response[:200]!r}, and its worker process was killed. Make it "
            "faster, or raise the limit with --reward-timeout SECONDS (0: no limit)."
        ) from None
    except WorkerFailed as e:
        raise UserError(
            f"--extract-answer {fn.spec} {e} on the completion {response[:200]!r}."
        ) from None
    except Exception as e:  # in the worker (RemoteError: its type's name) or here
        raise UserError(
            f"--extract-answer: {getattr(fn, '__name__', fn)} raised "
            f"{getattr(e, 'type_name', type(e).__name__)}: {e}{getattr(e, 'where', '')} on the "
            f"completion {response[:200]!r}. It must return the answer as a string, or None."
        ) from None
    return None if answer is None else str(answer)
