"""Process supervision (DeepSeekMath §4.1.3): a reward per reasoning step, per-token advantages.

A process reward function is a reward function (rewards.py's contract) that returns, for each
completion, a list of its steps' (end, reward) pairs instead of one number:

    def equations(completions, answers):   # a step per equation, 1 when it holds, else 0
        return [[(m.end(), float(holds(m))) for m in EQUATION.finditer(c)] for c in completions]

`end` is a character offset into the response the function was given (the response prefix, then
the completion): text[:end] is the step and everything before it, as re.Match.end() gives it. []
is a completion with no steps. Returning a list for the first completion is what makes a function
a process reward (support/sandbox.as_steps checks every pair: an int end >= 0, a finite reward).

From steps to Â_{i,t} (advantages, below):
1. Each step's end goes to the completion token that holds its last character, read from the
   decode's own tokens (token in, token out: the text is never tokenized again). A step ending
   inside a token maps to that token; one ending at or past the end of the text (EOS) to the
   completion's last sampled token (its EOS, where it has one); one ending inside tokens a tool's
   result forced in to the last sampled token before them; one ending before the completion's
   first character (inside the response prefix) to no token: it counts in the statistics of 2 but
   no token receives it.
2. Outcome and step rewards combine: the weighted sum of the task's outcome reward functions (those
   that return numbers) is one more step, at the completion's last sampled token; a process
   function's step rewards are multiplied by its weight. A task with process functions only has
   no outcome step.
3. grpo.process_advantages: every step reward of a group (all its completions' steps) is normalized
   with the group's mean and std, and Â_{i,t} is the sum of the normalized rewards of o_i's steps
   that end at or after token t. A group whose step rewards are all equal gets 0 everywhere; a
   completion with no steps and no outcome step gets 0.
With outcome functions only, 2 and 3 give exactly grpo.group_advantages' Â_i on every token
(tests/test_process_supervision.py).

Groups are whole on every process (torchrun splits prompts, not groups), so the statistics of 3
are each process's own; the [N, C] advantages then travel with their rows through micro-batches
and μ iterations as outcome ones do.
"""

import bisect

import grpo
from support.errors import UserError


def advantages(task, per_fn, steps, rollouts, tokenizer):
    """Â_{i,t} [N, C] on the rollouts' device for process supervision: `steps` {name: the
    sandbox.Steps of each process reward function} (what task.score returned in its `steps`),
    per_fn the functions' values [N] (the outcome ones' are used), task.rewards their weights."""
    N, C = rollouts.completion_mask.shape
    completion_ids = rollouts.input_ids[:, -C:].tolist()
    within = rollouts.attention_mask[:, -C:].sum(1).tolist()  # tokens up to EOS, forced included
    forced = None if rollouts.forced is None else rollouts.forced.tolist()
    outcome = [r for r in task.rewards if r.name not in steps]
    outcome_total = sum(r.weight * per_fn[r.name] for r in outcome) if outcome else None
    prefix = len(task.response_prefix)
    step_rewards, step_ends = [], []
    for i in range(N):
        ids = completion_ids[i][: within[i]]
        sampled = [True] * len(ids) if forced is None else [not f for f in forced[i][: len(ids)]]
        offsets = char_offsets(tokenizer, ids)
        rewards_i, ends_i = [], []
        for r in task.rewards:
            for end, reward in steps[r.name][i] if r.name in steps else ():
                rewards_i.append(r.weight * reward)
                ends_i.append(token_of(end - prefix, offsets, sampled))
        if outcome_total is not None:  # the outcome reward: one step at the last sampled token
            rewards_i.append(float(outcome_total[i]))
            ends_i.append(last_sampled(sampled, len(ids) - 1))
        step_rewards.append(rewards_i)
        step_ends.append(ends_i)
    adv = grpo.process_advantages(step_rewards, step_ends, rollouts.group_size, C)
    return adv.to(rollouts.input_ids.device)


def char_offsets(tokenizer, ids):
    """offsets[k]: how many characters of the completion's text (decoded as the reward functions
    saw it: special tokens dropped) are complete after tokens 0..k. A token that ends inside a
    multi-byte character decodes as a replacement character, not yet the text's: that character
    counts from the token that completes it. Nondecreasing."""
    texts = tokenizer.batch_decode(
        [ids[: k + 1] for k in range(len(ids))], skip_special_tokens=True
    )
    full, offsets, most = (texts[-1] if texts else ""), [], 0
    for text in texts:
        n = len(text)
        while n > most and not full.startswith(text[:n]):  # the longest prefix that is the text's
            n -= 1
        most = max(most, n)
        offsets.append(most)
    return offsets


def token_of(end, offsets, sampled):
    """The index of the token that holds character end - 1 of the completion's text (end: the
    step's end, relative to the completion), moved back to the last sampled token at or before it
    (a forced token is not the model's); the last sampled token where end reaches the end of the
    text; -1 (no token) where end <= 0 or no sampled token is at or before it."""
    if end <= 0 or not offsets:
        return -1
    k = len(offsets) - 1 if end >= offsets[-1] else bisect.bisect_left(offsets, end)
    return last_sampled(sampled, k)


def last_sampled(sampled, k):
    """The last index at or before k where sampled is True; -1 if none."""
    while k >= 0 and not sampled[k]:
        k -= 1
    return k


def check_settings(
    scale_rewards="group", dynamic_sampling=False, multi_reward="sum", kl_in_reward=False
):
    """A UserError for the trainer's options that a process reward cannot follow: each reads one
    reward per completion."""
    if scale_rewards != "group":
        raise UserError(
            f"--scale-rewards {scale_rewards}: a process reward's steps are normalized with their "
            "group's mean and std (DeepSeekMath §4.1.3), not per batch or not at all. Drop "
            "--scale-rewards, or return one number per completion from the reward functions."
        )
    if dynamic_sampling:
        raise UserError(
            "--dynamic-sampling keeps the groups whose total rewards differ; with a process reward "
            "a group whose totals are equal can still have steps that differ. Drop "
            "--dynamic-sampling, or return one number per completion from the reward functions."
        )
    if multi_reward == "gdpo":
        raise UserError(
            "--multi-reward gdpo normalizes each reward function's one number per completion in "
            "its group; a process reward gives steps, which are normalized over all the group's "
            "steps instead (DeepSeekMath §4.1.3). Drop --multi-reward, or return one number per "
            "completion from the reward functions."
        )
    if kl_in_reward:
        raise UserError(
            "--kl-in-reward subtracts beta times the KL from each completion's one reward; a "
            "process reward gives steps, normalized per token (DeepSeekMath §4.1.3). Drop "
            "--kl-in-reward (the KL then stays in the loss), or return one number per completion "
            "from the reward functions."
        )
