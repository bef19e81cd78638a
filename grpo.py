"""The GRPO math, in one file that depends on torch alone.

Group Relative Policy Optimization, DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), eq. 3:

  J(θ) = E[ 1/G Σ_i 1/|o_i| Σ_t { min( r_{i,t} Â_{i,t}, clip(r_{i,t}, 1-ε, 1+ε) Â_{i,t} )
                                   - β D_KL[π_θ || π_ref] } ]

  r_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
  D_KL    = π_ref/π_θ - log(π_ref/π_θ) - 1   (eq. 4; Schulman's k3 estimator, his blog post
                                            "Approximating KL Divergence", joschu.net)
  Â_{i,t} = (r_i - mean(r)) / std(r)         (outcome supervision, §4.1.2)

Shapes: N completions (= B prompts × G samples, laid out group after group), T completion tokens.
Copy this file into your project as it is: it depends on torch alone. The log-probs it takes come
from sampling.token_logprobs, or from any code that gives log π(o_t | q, o_<t) at the sampling
temperature.

grpo_loss is eq. 3, with the aggregations of DAPO and Dr. GRPO, GSPO's sequence ratio, the dual
clip, DeepSeek-V3.2's importance-weighted KL (kl_bias_correction) and the k2 estimator in place of
k3 (kl_estimator). What goes beyond it is a function of its own below, composed around grpo_loss by
its caller (trainer.py's micro_batch_loss): CISPO's, SAPO's and DPPO's policy terms in place of eq.
3's min (grpo_loss's `surrogate`), and DPPO's trust-region mask, the top-ρ entropy mask,
DeepSeek-V3.2's off-policy sequence mask and the sampler-trainer importance weights, which multiply
each token's policy term (their product is grpo_loss's `weights`). Beside group_advantages (eq. 3's
Â), gdpo_advantages and rloo_advantages share its statistics, and kl_penalty_rewards puts the KL in
the reward (k1) before them.
"""

import torch

__all__ = [
    "grpo_loss",
    "loss_denominator",
    "group_advantages",
    "gdpo_advantages",
    "rloo_advantages",
    "kl_penalty_rewards",
    "process_advantages",
    "completion_mask",
    "cispo_objective",
    "sapo_objective",
    "dppo_objective",
    "dppo_mask",
    "high_entropy_mask",
    "off_policy_mask",
    "sampler_weights",
    "sampler_mismatch",
]

# the sums grpo_loss's stats dict holds
STATS = ("tokens", "kl", "clipped", "ratio")
SAMPLER_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# exp() of a log-ratio above about 88 overflows fp32 (a token far off-policy, or far from π_ref):
# the loss would be inf and the update skipped. Bounded at 20 (a ratio of 4.9e8, far beyond any
# clip), the loss stays finite and such a token's ratio passes no gradient; every worked example
# lies far inside the bound.
MAX_LOG_RATIO = 20.0


def grpo_loss(
    logps, old_logps, ref_logps, advantages, mask, *, epsilon=0.2, epsilon_high=None, beta=0.04,
    loss_type="grpo", max_tokens=None, normalizer=None, ratio_level="token", delta=None,
    surrogate=None, weights=None, kl_bias_correction=False, kl_estimator="k3", stats=None,
):  # fmt: skip
    """-J(θ) of eq. 3 over one (micro-)batch: a scalar to minimize.

    logps      [N, T] log π_θ(o_t | q, o_<t), with grad.
    old_logps  [N, T] log π_old, or None when μ = 1 (π_old is π_θ: the ratio is exactly 1, the
               gradient intact).
    ref_logps  [N, T] log π_ref, or None (only when beta == 0; then no KL is computed at all).
    advantages [N] (one per completion, broadcast over its tokens) or [N, T] (per token, process
               supervision).
    mask       [N, T] 1 for the tokens in the loss: the completion up to and including EOS, 0
               after it and on the tokens a tool's result forced in (bool or numeric).
    epsilon_high: upper clip bound ε_high (DAPO's clip-higher, arXiv 2503.14476); default epsilon.
    loss_type: "grpo" 1/N Σ_i 1/|o_i| Σ_t (the paper) | "dapo" Σ_{i,t} / Σ_i |o_i| (token-level,
               arXiv 2503.14476) | "dr_grpo" Σ_{i,t} / (N · max_tokens) (arXiv 2503.20783).
    normalizer: loss_denominator of the WHOLE batch when this call sees one micro-batch of it:
               micro-batch losses then sum exactly to the full-batch loss. Default: this batch's.
    ratio_level: "token" (eq. 3) | "sequence" (GSPO, arXiv 2507.18071: one ratio per completion,
               exp of the mean token log-ratio).
    delta:     dual clip (INTELLECT-2, arXiv 2505.07291), None: off. Where Â < 0, min(r Â,
               clip(r) Â) falls without bound as r grows (r = 10, Â = -1: -10); min(r, δ) stops it
               at δ Â (δ > 1 + ε_high).
    surrogate: None: eq. 3's policy term min(r Â, clip(r, 1-ε, 1+ε_high) Â). Or a function
               (ratio [N, T], Â [N, 1] or [N, T], logps) -> (its per-token policy term [N, T],
               bool [N, T]: where a clip is active) in its place: cispo_objective, sapo_objective
               or dppo_objective, their settings bound with functools.partial. delta is the clip's.
    weights:   [N, T] or [N, 1], multiplying each token's policy term (not its KL); None: 1. The
               options that keep or weigh tokens, multiplied together: dppo_mask,
               high_entropy_mask, off_policy_mask, sampler_weights.
    kl_bias_correction: False: eq. 3's KL term, k3 on samples drawn from π_old. True: r · k3 (or
               r · k2, kl_estimator="k2"), with the policy term's r (token or sequence level,
               neither clipped nor detached): DeepSeek-V3.2's unbiased KL estimate (arXiv
               2512.02556, §3.1, eq. 7; TRL's use_bias_correction_kl). It changes the gradient
               whenever β ≠ 0, even at μ = 1 where r is exactly 1: d(r k3)/dlog π_θ = r log(π_θ /
               π_ref), where k3's is 1 - π_ref/π_θ. stats["kl"] stays Σ k3.
    kl_estimator: the KL term's estimator at each token, of x = log(π_θ/π_ref) (Schulman's
               "Approximating KL Divergence"). "k3" (eq. 4) = e^{-x} + x - 1, d/dlog π_θ = 1 -
               π_ref/π_θ: over π_θ's samples, the gradient of the forward KL(π_ref || π_θ). "k2" =
               x²/2, d/dlog π_θ = x: that of KL(π_θ || π_ref), the KL eq. 3 names. k1 = x goes in
               the reward (kl_penalty_rewards): as a loss its gradient is 1 on every sample, 0 in
               expectation. stats["kl"] stays Σ k3. E.g. x = ln 2: k3 = 0.193147 (gradient 0.5),
               k2 = 0.240227 (gradient 0.693147).
    stats: optional dict, filled with detached sums over this batch's unmasked tokens: "tokens",
               "kl" (Σ k3), "clipped" (tokens where a clip is active, δ's included), "ratio" (Σ r).
    """
    if loss_type not in ("grpo", "dapo", "dr_grpo"):
        raise ValueError(f"loss_type must be 'grpo', 'dapo' or 'dr_grpo', got {loss_type!r}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    if delta is not None and surrogate is not None:
        raise ValueError("delta (the dual clip) applies to eq. 3's clip only (surrogate=None)")
    if ref_logps is None and beta != 0:
        raise ValueError("ref_logps is None but beta != 0: the KL term needs reference log-probs")
    if kl_estimator not in ("k2", "k3"):
        raise ValueError(
            f"kl_estimator must be 'k2' or 'k3' (k1 goes in the reward: kl_penalty_rewards), "
            f"got {kl_estimator!r}"
        )
    # Each term of eq. 3 on its own line, its symbols aligned beside it.
    # fmt: off
    m = mask.bool()                                                          # [N, T]
    old = logps.detach() if old_logps is None else old_logps                 # μ = 1: π_old = sg(π_θ)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages      # Â_{i,t}: [N, 1] or [N, T]
    log_ratio = torch.where(m, logps - old, 0.0)                             # log r_{i,t}; 0 on masked tokens
    if ratio_level == "sequence":                                            # GSPO: s_i = exp(mean_t log r_{i,t})
        seq = log_ratio.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(m, seq.expand_as(log_ratio), 0.0)
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))                    # r_{i,t} = π_θ / π_old
    eps_high = epsilon if epsilon_high is None else epsilon_high
    if surrogate is None:
        clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)       # clip(r, 1-ε, 1+ε_high)
        unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)  # r, or min(r, δ): dual clip
        objective = torch.min(unclipped * adv, clipped_ratio * adv)         # min(r Â, clip(r) Â)
        # where a clip is active (stats["clipped"]): the min is clip(r) Â, or δ Â
        clipped = ((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - epsilon) & (adv < 0))
        if delta is not None:
            clipped |= (ratio > delta) & (adv < 0)
    else:                                                                    # CISPO's, SAPO's or DPPO's in its place
        objective, clipped = surrogate(ratio, adv, logps)
    if weights is not None:                                                  # × the masks and importance weights
        objective = objective * weights
    if beta != 0:
        log_ref_ratio = torch.where(m, ref_logps - logps, 0.0).clamp(max=MAX_LOG_RATIO)  # log(π_ref / π_θ)
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1                    # k3 = π_ref/π_θ - log(π_ref/π_θ) - 1 ≥ 0
        k3 = kl                                                              # stats["kl"]: Σ k3, whichever estimator
        if kl_estimator == "k2":                                             # or k2 = ½ log²(π_θ/π_ref) ≥ 0
            kl = log_ref_ratio**2 / 2
        penalty = kl * ratio if kl_bias_correction else kl                   # optional: r · k (DeepSeek-V3.2: r · k3)
        objective = objective - beta * penalty                               # ... - β D_KL
    objective = torch.where(m, objective, 0.0)                               # only tokens up to EOS count
    if loss_type == "grpo":                                                  # Σ_i 1/|o_i| Σ_t, over N (= 1/G Σ_i)
        total = (objective.sum(1) / m.sum(1).clamp(min=1)).sum()
    else:                                                                    # Σ_{i,t}, over Σ|o_i| or N·max_tokens
        total = objective.sum()
    # fmt: on
    if stats is not None:
        with torch.no_grad():
            stats["tokens"] = m.sum().item()
            stats["kl"] = k3.masked_fill(~m, 0).sum().item() if beta != 0 else 0.0
            stats["clipped"] = (clipped & m).sum().item()
            stats["ratio"] = ratio.masked_fill(~m, 0).sum().item()
    denominator = (
        loss_denominator(mask, loss_type, max_tokens) if normalizer is None else normalizer
    )
    denominator = torch.as_tensor(denominator, dtype=total.dtype, device=total.device).clamp(min=1)
    return -total / denominator  # maximize J ⇔ minimize -J


def loss_denominator(mask, loss_type="grpo", max_tokens=None):
    """What eq. 3's average divides by, for the completions of mask [N, T]: N sequences for "grpo"
    (each one already averaged over its own tokens), Σ_i |o_i| tokens for "dapo", N · max_tokens for
    "dr_grpo".

    grpo_loss uses it for its own batch. With gradient accumulation, pass the WHOLE batch's to every
    micro-batch's grpo_loss as `normalizer`: a mean per micro-batch would weigh short and long ones
    alike.
    """
    if loss_type == "grpo":
        return mask.shape[0]
    if loss_type == "dapo":
        return int(mask.bool().sum())
    if loss_type == "dr_grpo":
        if max_tokens is None:
            raise ValueError("loss_type='dr_grpo' needs max_tokens (the generation budget)")
        return mask.shape[0] * max_tokens
    raise ValueError(f"loss_type must be 'grpo', 'dapo' or 'dr_grpo', got {loss_type!r}")


def group_advantages(rewards, group_size, *, scale="group", eps=1e-4):
    """Â_i = (r_i - mean of its group) / std, for rewards [N] laid out group after group.

    scale: "group" divides by the group's std (the paper, §4.1.2), "batch" by the whole batch's std,
    "none" does not divide (Dr. GRPO, arXiv 2503.20783). std is Bessel-corrected (torch.std's
    default). A group whose rewards are all equal gets exactly 0: it carries no learning signal.
    The statistics are taken in float64, so that any finite rewards (float32's up to ±3.4e38, a
    weighted total beyond them) give finite advantages; they come back in float32 (where a centered
    reward left unscaled lies beyond float32's range, at ±3.4e38, its sign kept).
    gdpo_advantages and rloo_advantages share these statistics.
    """
    return finite_float32(group_normalized(rewards, group_size, scale, eps))  # [N]


def group_normalized(rewards, group_size, scale="group", eps=1e-4):
    """group_advantages' statistics, in float64 [N]: what gdpo_advantages and rloo_advantages
    build on, before finite_float32 returns them."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 to compare completions, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    r = rewards.double().view(-1, group_size)  # [B, G]; float64: finite rewards, finite stats
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)  # [B, 1]
    centered = torch.where(all_equal, 0.0, r - r.mean(dim=1, keepdim=True))  # r_i - mean(r)
    if scale == "group":
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.double().std() + eps)
    return centered.flatten()  # [N]


def finite_float32(advantages):
    """float64 advantages in float32, finite: a value beyond float32's range (only unscaled ones
    reach it: rewards of ±3e38 centered, or RLOO's ±6e38 from them) saturates at ±3.4e38."""
    largest = torch.finfo(torch.float32).max
    return advantages.clamp(-largest, largest).float()


def gdpo_advantages(rewards_per_fn, weights, group_size, *, eps=1e-4):
    """GDPO's advantages for several reward functions (GDPO, "Group reward-Decoupled Normalization
    Policy Optimization", arXiv 2601.05242; TRL's multi_objective_aggregation="normalize_then_sum"):
    each function's rewards normalized within their group first, then summed with their weights,
    then normalized over the batch:

      s_i = Σ_k w_k z_{i,k},   z_{i,k} = group_advantages of function k (group std, + eps)
      Â_i = (s_i - mean(s)) / (std(s) + eps),   mean and std (Bessel) over the whole batch

    Eq. 3's Â normalizes the weighted total instead, so each function pulls by its spread: the one
    with the largest drowns the others. E.g. one group, correctness (1, 1, 0, 0) and a format reward
    (0, 0.1, 0, 0.1), weights 1, eps → 0. The total (1, 1.1, 0, 0.1) gives (0.775555, 0.947900,
    -0.947900, -0.775555): the format moves Â by 0.172345, correctness by 1.723455, ten times more.
    GDPO's z-scores (0.866025, 0.866025, -0.866025, -0.866025) + (-0.866025, 0.866025, -0.866025,
    0.866025) give (0, 1.224745, -1.224745, 0): each moves it by 1.224745, as their weights say.
    rewards_per_fn [N, K] (one column per function, groups of group_size one after another),
    weights K numbers. With one function of weight 1: group_advantages, batch-normalized. Returns
    float32 [N], finite for any finite rewards (the statistics in float64, as group_advantages').
    """
    if rewards_per_fn.dim() != 2 or rewards_per_fn.shape[1] != len(weights) or len(weights) < 1:
        raise ValueError(
            f"rewards_per_fn must be [N, K] with one column per weight ({len(weights)}), "
            f"got shape {tuple(rewards_per_fn.shape)}"
        )
    summed = sum(  # s_i = Σ_k w_k z_{i,k}
        float(w) * group_normalized(rewards_per_fn[:, k], group_size, "group", eps)
        for k, w in enumerate(weights)
    )
    batch = group_normalized(summed, summed.numel(), "group", eps)  # over the batch: one group
    return finite_float32(batch)  # [N]


def rloo_advantages(rewards, group_size):
    """RLOO's leave-one-out baseline (REINFORCE Leave-One-Out: Kool et al. 2019, "Buy 4 REINFORCE
    samples, get a baseline for free!"; Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740):

      Â_i = r_i - 1/(G-1) Σ_{j≠i} r_j = G/(G-1) · (r_i - mean of its group)

    Completion i's baseline leaves its own reward out, so it does not depend on o_i and the policy
    gradient stays unbiased; eq. 3's group mean includes r_i and shrinks every Â_i by (G-1)/G. By
    the identity, RLOO is group_advantages(scale="none") (--scale-rewards none) times G/(G-1), a
    constant for a run: it needs no trainer flag of its own (at β = 0 an optimizer step of Adam's
    barely sees the constant; with β > 0, β · (G-1)/G keeps the KL's share). No std. rewards [N],
    groups of group_size one after another, G ≥ 2. Returns float32 [N] (finite, as group_advantages'
    with scale="none"). E.g. (1, 0, 0, 0): 1 - 0 = 1 and 0 - 1/3 = -1/3, which are 4/3 times the
    mean-centered (0.75, -0.25).
    """
    if group_size < 2:
        raise ValueError(
            f"rloo_advantages needs a group of at least 2: a group of one has no other reward to "
            f"leave out, got group_size={group_size}"
        )
    centered = group_normalized(rewards, group_size, "none")  # r_i - mean of its group
    return finite_float32(centered * group_size / (group_size - 1))  # × G/(G-1)


def kl_penalty_rewards(rewards, logps, ref_logps, mask, beta):
    """k1 in the reward (TRL issue #4967; "A Comedy of Estimators: On KL Regularization in RL
    Training of LLMs", arXiv 2512.21852): each completion's reward less β times its log-ratio to
    the reference, summed over its tokens, before the group normalization:

      r_i - β Σ_t log(π_θ(o_t | q, o_<t) / π_ref(o_t | q, o_<t)),   over completion i's loss tokens

    The sum is k1 over the sequence (Schulman's "Approximating KL Divergence"), an unbiased estimate
    of KL(π_θ || π_ref) for the completion. Through the policy gradient its expected gradient is
    that KL's own, E[k1 ∇log π_θ] = ∇KL (E[∇log π_θ] = 0), where k1 as a loss has the gradient 1 on
    every sample, 0 in expectation. Use it with grpo_loss's beta = 0, and before group_advantages,
    gdpo_advantages or rloo_advantages (with scale "group", β is in units of the group's std).
    rewards [N]; logps (the policy that sampled: π_old, or the sampler's), ref_logps and mask
    [N, T]. A reward carries no gradient: returns float64 [N], detached. E.g. reward 1, β = 0.1,
    one token with π_θ/π_ref = 2: 1 - 0.1 ln 2 = 0.930685.
    """
    m = mask.bool()
    log_ratio = torch.where(m, logps.detach().double() - ref_logps.detach().double(), 0.0)  # k1_t
    return rewards.detach().double() - beta * log_ratio.sum(1)  # r_i - β Σ_t k1_t


def process_advantages(step_rewards, step_ends, group_size, num_tokens, *, eps=1e-4):
    """Process supervision (DeepSeekMath §4.1.3): per-token advantages [N, num_tokens].

    step_rewards[i]: the rewards of completion i's reasoning steps; step_ends[i]: the index of the
    last token of each step. Rewards are normalized with the mean and std of all step rewards in the
    group, and token t's advantage is the sum of the normalized rewards of the steps that end at or
    after t.
    """
    n = len(step_rewards)
    if n != len(step_ends) or group_size < 1 or n % group_size:
        raise ValueError(
            "step_rewards and step_ends need one entry per completion, a multiple of group_size"
        )
    advantages = torch.zeros(n, num_tokens)
    for g in range(0, n, group_size):
        pooled = torch.tensor(
            [r for i in range(g, g + group_size) for r in step_rewards[i]], dtype=torch.float32
        )
        if pooled.numel() == 0:
            continue
        equal = bool((pooled == pooled[0]).all())
        mean, std = pooled.mean(), (pooled.std() if pooled.numel() > 1 else torch.tensor(0.0))
        for i in range(g, g + group_size):
            if len(step_rewards[i]) != len(step_ends[i]):
                raise ValueError(
                    f"completion {i}: {len(step_rewards[i])} step rewards but "
                    f"{len(step_ends[i])} step ends"
                )
            for reward, end in zip(step_rewards[i], step_ends[i]):
                normalized = 0.0 if equal else (reward - mean) / (std + eps)
                advantages[i, : min(int(end), num_tokens - 1) + 1] += normalized  # tokens t <= end
    return advantages


def completion_mask(completion_ids, eos_token_id):
    """[N, T] int64: 1 for each token up to and including the first EOS, 0 after it; all ones
    without EOS.

    Built from the EOS ids, never from the pad id: many models pad with EOS, and masking "pad" would
    drop the EOS token itself from the loss, so the policy would never learn to stop.
    """
    if eos_token_id is None:
        raise ValueError("eos_token_id is None: the tokenizer has no EOS token to end completions")
    eos = torch.as_tensor(eos_token_id, device=completion_ids.device).reshape(-1)
    is_eos = torch.isin(completion_ids, eos).long()  # [N, T]
    eos_before = is_eos.cumsum(dim=1) - is_eos  # EOS tokens strictly before t
    return (eos_before == 0).long()


# --------------------------------------------------------------------------------------------------
# Beyond eq. 3: each a function of its own, composed around grpo_loss by its caller. CISPO's,
# SAPO's and DPPO's policy terms go in grpo_loss's `surrogate` (functools.partial binds their
# settings); the masks and importance weights multiply each token's policy term (grpo_loss's
# `weights`: their product). Every one is off in the paper's GRPO.


def cispo_objective(ratio, advantages, logps, epsilon_high=0.2):
    """CISPO's per-token policy term, in place of eq. 3's min (MiniMax-M1, arXiv 2506.13585):

      J_t = sg(r̂_t) Â_t log π_θ(o_t | q, o_<t),   r̂_t = min(r_t, 1 + ε_high)

    The importance weight is clipped and its gradient stopped (sg), so every token keeps a gradient
    r̂ Â, where eq. 3's clip zeroes the clipped tokens'. No lower bound (ε unused), as the paper ran
    it. ratio [N, T] (grpo_loss's r, token or sequence level), advantages [N, 1] or [N, T], logps
    [N, T] with grad. Returns (J_t [N, T], bool [N, T]: where the cap binds). E.g. r = 1.5, Â = 1,
    ε_high = 0.2: J = 1.2 ln 1.5 = 0.486558, dJ/dlog π = 1.2."""
    weight = torch.clamp(ratio, max=1 + epsilon_high).detach()  # sg(r̂), r̂ = min(r, 1 + ε_high)
    return weight * advantages * logps, ratio > 1 + epsilon_high  # sg(r̂) Â log π_θ


def sapo_objective(ratio, advantages, logps=None, tau_pos=1.0, tau_neg=1.05):
    """SAPO's per-token policy term, in place of eq. 3's min (arXiv 2511.20347): a soft gate for
    the hard clip,

      J_t = σ(τ (r_t - 1)) · 4/τ · Â_t,   τ = τ+ where Â_t > 0, else τ-
      dJ_t/dlog π_θ = 4 r_t σ (1 - σ) Â_t   (Â_t at r = 1, as eq. 3's; damped, never cut, far off)

    ratio [N, T], advantages [N, 1] or [N, T]; logps unused (grpo_loss's surrogate signature).
    Returns (J_t [N, T], bool [N, T] all False: no clip is ever active). E.g. r = 1.5, Â = 1:
    J = 4 σ(0.5) = 2.489837, dJ/dlog π = 1.410022."""
    tau = torch.where(advantages > 0, tau_pos, tau_neg)  # τ+ where Â > 0, else τ-
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages  # σ(τ (r - 1)) · 4/τ · Â
    return gate, torch.zeros_like(ratio, dtype=torch.bool)


def dppo_objective(ratio, advantages, logps=None):
    """DPPO's per-token policy term, in place of eq. 3's min: PPO's r Â with no clip, its trust
    region being dppo_mask's (grpo_loss's weights) instead:

      J_t = r_t Â_t,   dJ_t/dlog π_θ = r_t Â_t

    prime-rl writes it so (keep · r · Â); verl writes keep · sg(min(r, 20)) · Â · log π_θ. Below
    r = 20 their gradients are the same. This form is kept because its value is eq. 3's own wherever
    no clip binds (Â at r = 1: the logged loss reads as eq. 3's, where verl's, like CISPO's, is
    Â log π_θ), and because it is PPO's surrogate with only the mask changed, which is how the DPPO
    paper sets the two side by side. verl's cap is one partial away: the same mask with
    cispo_objective(epsilon_high=19) is sg(min(r, 20)) Â log π_θ exactly. ratio [N, T],
    advantages [N, 1] or [N, T]; logps unused. Returns (J_t [N, T], bool [N, T] all False: no clip;
    what dppo_mask drops is counted from its zeros). E.g. r = 1.5, Â = 1: J = 1.5, dJ/dlog π =
    1.5, where eq. 3 clips to 1.2 with no gradient."""
    return ratio * advantages, torch.zeros_like(ratio, dtype=torch.bool)  # r Â


def high_entropy_mask(entropy, mask, rho):
    """The top-ρ tokens by entropy ("Beyond the 80/20 Rule", Wang et al., arXiv 2506.01939: the
    policy gradient through the top ρ = 0.2 of tokens by entropy):

      M_t = 1[H_t ≥ q_{1-ρ}],   q_{1-ρ}: the (1 - ρ) quantile of the unmasked tokens' entropies

    entropy [N, T] H(π_θ(· | q, o_<t)), mask [N, T]; returns M [N, T] bool (masked tokens False).
    The quantile interpolates linearly (torch.quantile), as TRL's top_entropy_quantile does; a
    token tied with the threshold is kept, so ties can keep more than a share ρ. ρ = 0 keeps the
    highest-entropy tokens only, ρ = 1 all. As grpo_loss's weights it drops the policy term of the
    other tokens, not their KL. E.g. entropies (0.1, 0.5, 0.5, 0.5, 0.9), ρ = 0.2: q = 0.58, the
    last token alone."""
    if not 0 <= rho <= 1:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    m = mask.bool()
    values = entropy[m].float()
    if values.numel() == 0:
        return m
    threshold = torch.quantile(values, 1 - rho)  # q_{1-ρ}
    return (entropy >= threshold) & m  # M_t = 1[H_t ≥ q_{1-ρ}]


def off_policy_mask(advantages, logps, behavior_logps, mask, threshold):
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9):

      M_i = 0 if Â_i < 0 and 1/|o_i| Σ_t log(π_behavior(o_t) / π_θ(o_t)) > δ, else 1

    The mean over completion i's tokens estimates KL(π_behavior || π_θ) from its own samples: a
    negative update from samples the policy has moved away from is the one that destabilizes
    training. π_behavior: the policy the tokens were drawn from (the sampler's log-probs where
    kept, else π_old's). Returns M [N, 1] (or [N, T] with per-token advantages) 0/1 in logps'
    dtype, no gradient: grpo_loss's weights. E.g. gaps (0.4, 0.8): mean 0.6; Â = -1 and δ = 0.5:
    0; δ = 0.6 or Â = +1: 1."""
    m = mask.bool()
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    gap = torch.where(m, behavior_logps - logps.detach(), 0.0)  # log π_behavior / π_θ
    kl = gap.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)  # [N, 1]: its mean
    return ((adv >= 0) | (kl <= threshold)).to(logps.dtype)


def dppo_mask(advantages, logps, behavior_logps, mask, delta_low, delta_high, divergence="tv"):
    """DPPO's trust region on the sampled token's probability, in place of the ratio clip (Qi et
    al., "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879). With p =
    π_θ(o_t | q, o_<t) and b = π_behavior's, the policy that drew the token:

      "tv" (binary TV, |p - b|):  M_t = 0 where Â > 0 and p - b > δ_high, or Â < 0 and b - p > δ_low
      "kl" (binary KL):           M_t = 0 where Â > 0, p > b and D > δ_high, or Â < 0, p < b and
                                  D > δ_low;  D = b log(b/p) + (1-b) log((1-b)/(1-p)),
                                  the KL between Bernoulli(b) and Bernoulli(p)
      else M_t = 1

    A token is dropped only where the update would push it further out: p grown too far under
    Â > 0, shrunk too far under Â < 0. The ratio p/b swings on rare tokens and barely moves on
    likely ones; |p - b| does neither. E.g. b = 0.5, δ = 0.2 (TV) or 0.05 (KL):
      p = 0.8: TV 0.3, D 0.223144: dropped where Â > 0; kept where Â < 0 (the update lowers p)
      p = 0.2: TV 0.3, D 0.223144: dropped where Â < 0; kept where Â > 0
      p = 0.6: TV 0.1, D 0.020411: kept either way
    π_behavior: the sampler's log-probs where the decode keeps them (--sampler-correction), else
    π_old's. At μ = 1 with π_old = π_θ and no sampler log-probs, b is p itself: DPPO drops nothing,
    and what is left is the policy gradient with no trust region at all. advantages [N] or [N, T];
    logps, behavior_logps, mask [N, T] (off_policy_mask's order). Returns M [N, T] 0/1 in logps'
    dtype (masked tokens 0), no gradient: grpo_loss's weights, with dppo_objective its surrogate."""
    if divergence not in ("tv", "kl"):
        raise ValueError(f"divergence must be 'tv' or 'kl', got {divergence!r}")
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    with torch.no_grad():
        log_p = logps.double().clamp(max=0)
        log_b = behavior_logps.double().clamp(max=0)
        grown = torch.exp(log_p) - torch.exp(log_b)  # p - b
        if divergence == "tv":
            too_high = grown > delta_high
            too_low = -grown > delta_low
        else:
            d = bernoulli_kl(log_b, log_p)
            too_high = (grown > 0) & (d > delta_high)
            too_low = (grown < 0) & (d > delta_low)
        drop = ((adv > 0) & too_high) | ((adv < 0) & too_low)
    return (mask.bool() & ~drop).to(logps.dtype)


def bernoulli_kl(log_b, log_p):
    """KL(Bernoulli(b) || Bernoulli(p)) = b log(b/p) + (1-b) log((1-b)/(1-p)), from log b and log p
    (float64): a term whose weight b or 1 - b is 0 is 0; p = 1 (or 0) against b < 1 (or > 0) is
    inf. E.g. b = 0.5, p = 0.8: 0.5 ln 0.625 + 0.5 ln 2.5 = 0.223144."""
    b = torch.exp(log_b)
    log_not_b = torch.log(-torch.expm1(log_b))  # log(1 - b)
    log_not_p = torch.log(-torch.expm1(log_p))  # log(1 - p)
    sampled = torch.where(b > 0, b * (log_b - log_p), 0.0)  # b log(b/p)
    other = torch.where(b < 1, (1 - b) * (log_not_b - log_not_p), 0.0)  # (1-b) log((1-b)/(1-p))
    return sampled + other


def sampler_weights(old_logps, sampler_logps, mask, mode="token_truncate", low=0.0, high=3.0):
    """Importance weights w = π_old / π_sampler for the sampler-trainer mismatch: the tokens were
    drawn by one numerical path (the decode: a KV cache, another kernel, another dtype) and are
    trained on through another (the training forward), whose log-probs π_old are the ones the
    ratio uses. Truncated importance sampling (Yao et al., "Your efficient RL framework secretly
    brings you off-policy RL training", 2025) and TRL's vllm_importance_sampling_mode:
      token_truncate     w_t = clamp(π_old/π_sampler, low, high), per token
      token_mask         w_t = π_old/π_sampler, or 0 where it is outside [low, high]
      sequence_truncate  w_i = clamp(Π_t π_old/π_sampler, low, high), one per completion
      sequence_mask      w_i = Π_t π_old/π_sampler, or 0 outside [low, high]
    old_logps, sampler_logps, mask [N, T]; the masked tokens count as ratio 1. Returns
    (weights [N, T] or [N, 1], no grad: grpo_loss's weights; [same] bool: where they were
    truncated or masked). E.g. token ratios (0.5, 1, 5), token_truncate to [0, 3]: (0.5, 1, 3)."""
    if mode not in SAMPLER_MODES:
        raise ValueError(f"mode must be one of {SAMPLER_MODES}, got {mode!r}")
    with torch.no_grad():
        log_w = torch.where(mask.bool(), old_logps - sampler_logps, 0.0)  # log π_old/π_sampler
        if mode.startswith("sequence"):
            log_w = log_w.sum(1, keepdim=True)  # Σ_t: the completion's ratio
        w = torch.exp(log_w)
        outside = (w < low) | (w > high)
        if mode.endswith("truncate"):
            return w.clamp(low, high), outside
        return w.masked_fill(outside, 0.0), outside


def sampler_mismatch(trainer_logps, sampler_logps, mask):
    """How far the sampler's log-probs of the sampled tokens are from the trainer's for the same
    weights and the same distribution (the full softmax at the sampling temperature): (mean k3
    estimate of KL(π_sampler || π_trainer) over the unmasked tokens, the largest token ratio
    max(π_trainer/π_sampler, π_sampler/π_trainer) >= 1), or None without unmasked tokens. Exactly
    (0, 1) when both paths compute the same numbers."""
    m = mask.bool()
    if not m.any():
        return None
    log_r = (trainer_logps - sampler_logps).double()[m]  # log π_trainer / π_sampler
    k3 = torch.exp(log_r) - log_r - 1  # ≥ 0, samples from π_sampler
    return k3.mean().item(), torch.exp(log_r.abs().max()).item()
