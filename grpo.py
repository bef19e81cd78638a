"""The GRPO math, in one file that depends on torch alone.

Group Relative Policy Optimization, DeepSeekMath (Shao et al. 2024, arXiv 2402.03300), eq. 3:

  J(θ) = E[ 1/G Σ_i 1/|o_i| Σ_t { min( r_{i,t} Â_{i,t}, clip(r_{i,t}, 1-ε, 1+ε) Â_{i,t} ) - β D_KL[π_θ || π_ref] } ]

  r_{i,t} = π_θ(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
  D_KL    = π_ref/π_θ - log(π_ref/π_θ) - 1        (eq. 4; Schulman's k3, http://joschu.net/blog/kl-approx.html)
  Â_{i,t} = (r_i - mean(r)) / std(r)               (outcome supervision, §4.1.2)

Shapes: N completions (= B prompts × G samples, laid out group after group), T completion tokens.
Copy this file into your project as it is; nothing here imports transformers.
"""
import torch
import torch.utils.checkpoint

__all__ = ["grpo_loss", "group_advantages", "process_advantages", "completion_mask", "token_logprobs"]


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, epsilon=0.2, epsilon_high=None, beta=0.04,
              loss_type="grpo", max_tokens=None, normalizer=None, ratio_level="token", stats=None):
    """-J(θ) of eq. 3 over one (micro-)batch: a scalar to minimize.

    logps      [N, T] log π_θ(o_t | q, o_<t), with grad.
    old_logps  [N, T] log π_old, or None when μ = 1 (π_old is π_θ: the ratio is exactly 1, the gradient intact).
    ref_logps  [N, T] log π_ref, or None (only when beta == 0; then no KL is computed at all).
    advantages [N] (one per completion, broadcast over its tokens) or [N, T] (per token, process supervision).
    mask       [N, T] 1 for completion tokens up to and including EOS, 0 after (bool or numeric).
    epsilon_high: upper clip bound ε_high (DAPO's clip-higher, arXiv 2503.14476); defaults to epsilon.
    loss_type: "grpo" 1/N Σ_i 1/|o_i| Σ_t (the paper) | "dapo" Σ_{i,t} / Σ_i |o_i| (token-level, arXiv 2503.14476)
               | "dr_grpo" Σ_{i,t} / (N · max_tokens) (arXiv 2503.20783).
    normalizer: the denominator above for the WHOLE batch when this call sees one micro-batch of it
               (sequences for grpo, tokens for dapo, N·max_tokens for dr_grpo): micro-batch losses then sum
               exactly to the full-batch loss. Default: this batch's own.
    ratio_level: "token" (eq. 3) | "sequence" (GSPO, arXiv 2507.18071: one ratio per completion,
               exp of the mean token log-ratio).
    stats: optional dict, filled with detached sums over this batch's unmasked tokens:
               "tokens", "kl" (Σ k3), "clipped" (tokens where the clip is active), "ratio" (Σ r).
    """
    if loss_type not in ("grpo", "dapo", "dr_grpo"):
        raise ValueError(f"loss_type must be 'grpo', 'dapo' or 'dr_grpo', got {loss_type!r}")
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    if ref_logps is None and beta != 0:
        raise ValueError("ref_logps is None but beta != 0: the KL term needs reference log-probs")
    if loss_type == "dr_grpo" and max_tokens is None and normalizer is None:
        raise ValueError("loss_type='dr_grpo' needs max_tokens (the generation budget)")
    m = mask.bool()                                                          # [N, T]
    old = logps.detach() if old_logps is None else old_logps                 # μ = 1: π_old = sg(π_θ)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages      # Â_{i,t}: [N, 1] or [N, T]
    log_ratio = torch.where(m, logps - old, 0.0)                             # log r_{i,t}; 0 on masked tokens
    if ratio_level == "sequence":                                            # GSPO: s_i = exp(mean_t log r_{i,t})
        seq = log_ratio.sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(m, seq.expand_as(log_ratio), 0.0)
    ratio = torch.exp(log_ratio)                                             # r_{i,t} = π_θ / π_old
    eps_high = epsilon if epsilon_high is None else epsilon_high
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)           # clip(r, 1-ε, 1+ε_high)
    objective = torch.min(ratio * adv, clipped_ratio * adv)                 # min(r Â, clip(r) Â)
    if beta != 0:
        log_ref_ratio = torch.where(m, ref_logps - logps, 0.0)               # log(π_ref / π_θ)
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1                    # k3 = π_ref/π_θ - log(π_ref/π_θ) - 1 ≥ 0
        objective = objective - beta * kl                                    # ... - β D_KL
    objective = torch.where(m, objective, 0.0)                               # only tokens up to EOS count
    if loss_type == "grpo":                                                  # 1/|o_i| Σ_t, then 1/G Σ_i
        total = (objective.sum(1) / m.sum(1).clamp(min=1)).sum()
        denominator = logps.shape[0]
    elif loss_type == "dapo":                                                # Σ_{i,t} / Σ_i |o_i|
        total, denominator = objective.sum(), m.sum()
    else:                                                                    # Σ_{i,t} / (N · max_tokens)
        total, denominator = objective.sum(), logps.shape[0] * (max_tokens or 1)
    if normalizer is not None:
        denominator = normalizer
    if stats is not None:
        with torch.no_grad():
            clip_active = ((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - epsilon) & (adv < 0))
            stats["tokens"] = m.sum().item()
            stats["kl"] = kl.masked_fill(~m, 0).sum().item() if beta != 0 else 0.0
            stats["clipped"] = (clip_active & m).sum().item()
            stats["ratio"] = ratio.masked_fill(~m, 0).sum().item()
    denominator = torch.as_tensor(denominator, dtype=total.dtype, device=total.device).clamp(min=1)
    return -total / denominator                                              # maximize J ⇔ minimize -J


def group_advantages(rewards, group_size, *, scale="group", eps=1e-4):
    """Â_i = (r_i - mean of its group) / std, for rewards [N] laid out group after group.

    scale: "group" divides by the group's std (the paper, §4.1.2), "batch" by the whole batch's std,
    "none" does not divide (Dr. GRPO, arXiv 2503.20783). std is Bessel-corrected (torch.std's default).
    A group whose rewards are all equal gets exactly 0: it carries no learning signal.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if group_size < 2:
        raise ValueError(f"group_size must be at least 2 to compare completions, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)                                 # [B, G]
    all_equal = (r == r[:, :1]).all(dim=1, keepdim=True)                     # [B, 1]
    centered = torch.where(all_equal, 0.0, r - r.mean(dim=1, keepdim=True))  # r_i - mean(r)
    if scale == "group":
        centered = centered / (r.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.float().std() + eps)
    return centered.flatten()                                                # [N]


def process_advantages(step_rewards, step_ends, group_size, num_tokens, *, eps=1e-4):
    """Process supervision (DeepSeekMath §4.1.3): per-token advantages [N, num_tokens].

    step_rewards[i]: the rewards of completion i's reasoning steps; step_ends[i]: the index of the last token
    of each step. Rewards are normalized with the mean and std of all step rewards in the group, and token t's
    advantage is the sum of the normalized rewards of the steps that end at or after t.
    """
    n = len(step_rewards)
    if n != len(step_ends) or group_size < 1 or n % group_size:
        raise ValueError("step_rewards and step_ends need one entry per completion, a multiple of group_size")
    advantages = torch.zeros(n, num_tokens)
    for g in range(0, n, group_size):
        pooled = torch.tensor([r for i in range(g, g + group_size) for r in step_rewards[i]], dtype=torch.float32)
        if pooled.numel() == 0:
            continue
        equal = bool((pooled == pooled[0]).all())
        mean, std = pooled.mean(), (pooled.std() if pooled.numel() > 1 else torch.tensor(0.0))
        for i in range(g, g + group_size):
            if len(step_rewards[i]) != len(step_ends[i]):
                raise ValueError(f"completion {i}: {len(step_rewards[i])} step rewards but "
                                 f"{len(step_ends[i])} step ends")
            for reward, end in zip(step_rewards[i], step_ends[i]):
                normalized = 0.0 if equal else (reward - mean) / (std + eps)
                advantages[i, : min(int(end), num_tokens - 1) + 1] += normalized  # tokens t <= end
    return advantages


def completion_mask(completion_ids, eos_token_id):
    """[N, T] int64: 1 for each token up to and including the first EOS, 0 after it; all ones without EOS.

    Built from the EOS ids, never from the pad id: many models pad with EOS, and masking "pad" would
    drop the EOS token itself from the loss, so the policy would never learn to stop.
    """
    if eos_token_id is None:
        raise ValueError("eos_token_id is None: the tokenizer has no EOS token to end completions")
    eos = torch.as_tensor(eos_token_id, device=completion_ids.device).reshape(-1)
    is_eos = torch.isin(completion_ids, eos).long()                          # [N, T]
    eos_before = is_eos.cumsum(dim=1) - is_eos                               # EOS tokens strictly before t
    return (eos_before == 0).long()


def _chosen_logprobs(logits, targets, temperature, chunk_size):
    """log softmax(logits / temperature)[target] for logits [M, V], targets [M], chunk_size rows at a time.

    The chosen logit minus the logsumexp: only a [chunk_size, V] fp32 temporary exists at a time, never the full
    fp32 [M, V] log-softmax. With grad, each chunk is recomputed in backward instead of keeping its fp32 copy.
    """
    def chunk_logprobs(chunk, chunk_targets):
        chunk = chunk.float() / temperature                                  # [chunk, V]
        return chunk.gather(-1, chunk_targets[:, None]).squeeze(-1) - torch.logsumexp(chunk, dim=-1)

    recompute = torch.is_grad_enabled() and logits.requires_grad
    out = []
    for s in range(0, logits.shape[0], chunk_size):
        args = (logits[s:s + chunk_size], targets[s:s + chunk_size])
        out.append(torch.utils.checkpoint.checkpoint(chunk_logprobs, *args, use_reentrant=False) if recompute
                   else chunk_logprobs(*args))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)


class _LinearLogprobs(torch.autograd.Function):
    """log softmax(h Wᵀ / temperature)[target] for hidden states h [M, H] and an lm-head weight W [V, H],
    computed chunk by chunk, recomputing each chunk's logits in backward: [M, V] logits never exist.
    Under autocast the matmuls run in the autocast dtype, as the model's own lm-head would, in forward and in
    backward alike, so backward recomputes exactly the logits forward saw."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        out = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        lse = torch.empty_like(out)
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            for s in range(0, h.shape[0], chunk_size):
                logits = (h[s:s + chunk_size] @ w.T).float() / temperature       # [chunk, V]
                lse[s:s + chunk_size] = torch.logsumexp(logits, dim=-1)
                out[s:s + chunk_size] = logits.gather(-1, targets[s:s + chunk_size, None]).squeeze(-1)
        # The last chunk's logits are kept for backward, which starts with it: a batch that fits in one chunk (a
        # typical micro-batch) is never recomputed, at the cost of holding one [chunk, V] block until backward.
        last = logits if h.shape[0] else None
        ctx.save_for_backward(hidden, weight, targets, lse, last)
        ctx.temperature, ctx.chunk_size, ctx.dtype = temperature, chunk_size, dtype
        return out - lse

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse, last = ctx.saved_tensors
        size, device = ctx.chunk_size, hidden.device.type
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        with torch.autocast(device, enabled=False):
            h, w = hidden.to(ctx.dtype), weight.to(ctx.dtype)
            starts = list(range(0, h.shape[0], size))
            for s in reversed(starts):
                logits = last if s == starts[-1] else (h[s:s + size] @ w.T).float() / ctx.temperature
                # d logp / d logits = onehot(target) - softmax, times the incoming gradient and 1/temperature
                grad_logits = -torch.exp(logits - lse[s:s + size, None])
                grad_logits.scatter_add_(-1, targets[s:s + size, None], torch.ones_like(grad_logits[:, :1]))
                grad_logits = (grad_logits * (grad_out[s:s + size, None] / ctx.temperature)).to(ctx.dtype)
                if grad_hidden is not None:
                    grad_hidden[s:s + size] = grad_logits @ w
                if grad_weight is not None:
                    grad_weight += (grad_logits.T @ h[s:s + size]).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


# Architectures whose logits are exactly lm_head(final hidden state): no soft-capping, no logit scaling, no bias.
_PLAIN_HEAD_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


def _plain_linear_head(model):
    """The lm-head Linear when the model's logits are exactly hidden @ Wᵀ, else None (use the logits path)."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if (getattr(config, "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES or not isinstance(head, torch.nn.Linear)
            or head.bias is not None or getattr(model, "model", None) is None):
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    return head


def _features(model, input_ids, attention_mask, position_ids, num_positions, use_cache=False, past_key_values=None):
    """Run the model; return (features of the last num_positions positions, plain lm-head or None, cache).

    For plain-head models the features are final hidden states [N, k, H] (the head is applied chunk by chunk
    later); otherwise they are logits [N, k, V], asked for with logits_to_keep so no more are computed.
    """
    head = _plain_linear_head(model)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  past_key_values=past_key_values, use_cache=use_cache)
    if head is not None:
        out = model.model(**kwargs)
        features = out.last_hidden_state[:, out.last_hidden_state.shape[1] - num_positions:]
    else:
        out = model(**kwargs, logits_to_keep=num_positions)
        features = out.logits[:, out.logits.shape[1] - num_positions:]
    return features, head, getattr(out, "past_key_values", None)


def _logprobs(features, head, targets, temperature, chunk_size):
    """[N, k] log-probs of targets [N, k] from _features' output."""
    n, k = targets.shape
    flat = features.reshape(n * k, features.shape[-1])
    if head is not None:
        return _LinearLogprobs.apply(flat, head.weight, targets.reshape(-1), temperature, chunk_size).view(n, k)
    return _chosen_logprobs(flat, targets.reshape(-1), temperature, chunk_size).view(n, k)


def token_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0, *,
                   group_size=1, chunk_size=1024):
    """[N, C] fp32 log π(o_t | q, o_<t) of the last C = num_completion_tokens tokens of input_ids [N, P + C].

    The logits are divided by the sampling temperature, so these are the probabilities generation sampled
    from. Position ids come from the attention mask, so left-padded rows see the positions generation gave them.
    group_size=G > 1 says rows come group after group and each group's G rows share one prompt (the first
    P columns): each prompt then runs through the model once and its KV cache is repeated G times, instead of
    recomputing it G times; gradients flow back through the cache. Models whose cache cannot be repeated fall
    back to the plain path. For Llama-style heads no [N, C, V] logits tensor is ever built (chunked lm-head).
    """
    n, length = input_ids.shape
    c = num_completion_tokens
    if not 0 < c < length:
        raise ValueError(f"num_completion_tokens must be in [1, {length - 1}] for inputs of length {length}, got {c}")
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rows cannot be split into groups of {group_size}")
    position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)     # [N, P + C]
    targets = input_ids[:, -c:]                                               # [N, C]
    p = length - c
    # Gradient checkpointing turns the cache off in training, so the shared-prompt path cannot run there.
    flag = ("is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing")
            else "is_gradient_checkpointing")                                # renamed in transformers 5
    checkpointing = getattr(model, flag, False) and model.training
    if group_size > 1 and not checkpointing:
        # Each prompt once: [B, P]. Its last position predicts every row's first completion token.
        first, head, cache = _features(model, input_ids[::group_size, :p], attention_mask[::group_size, :p],
                                       position_ids[::group_size, :p], 1, use_cache=True)
        if cache is not None and hasattr(cache, "batch_repeat_interleave"):
            first = _logprobs(first.repeat_interleave(group_size, dim=0), head, targets[:, :1],
                              temperature, chunk_size)                        # [N, 1]
            if c == 1:
                return first
            cache.batch_repeat_interleave(group_size)                        # [B, ...] -> [B*G, ...]
            # Completion tokens 0..C-2 predict tokens 1..C-1, attending to the cached prompt and each other.
            rest, head, _ = _features(model, input_ids[:, p:-1], attention_mask[:, :-1], position_ids[:, p:-1],
                                      c - 1, use_cache=True, past_key_values=cache)
            return torch.cat([first, _logprobs(rest, head, targets[:, 1:], temperature, chunk_size)], dim=1)
    # Plain path: positions P-1 .. P+C-2 predict the C completion tokens.
    features, head, _ = _features(model, input_ids[:, :-1], attention_mask[:, :-1], position_ids[:, :-1], c)
    return _logprobs(features, head, targets, temperature, chunk_size)
