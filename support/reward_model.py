"""--reward-model: a sequence classifier whose score for a prompt and its response is the reward."""

import torch

from support.errors import UserError


class RewardModel:
    """A --reward-model: a sequence classifier with one output (num_labels=1) whose score for prompt
    + response is the reward. Frozen, it runs in batches under no_grad on the training device, in
    `dtype` (the run's compute dtype, from rewards.from_flags: bf16 on CUDA by default). Its
    text: the model's chat template over the user prompt and the assistant response when its
    tokenizer has one, else the prompt, a newline and the response. Fits the reward-function
    contract (rewards.py)."""

    def __init__(
        self, path_or_id, device="cpu", trust_remote_code=False, batch_size=16, dtype=torch.float32
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                path_or_id, trust_remote_code=trust_remote_code
            )
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path_or_id, dtype=dtype, trust_remote_code=trust_remote_code
            )
        except Exception as e:  # missing, offline, not a sequence classifier
            raise UserError(
                f"--reward-model {path_or_id!r}: could not load it as a sequence classifier "
                f"({' '.join(str(e).split())[:300]}). Pass a local directory with config.json, the "
                "weights and a tokenizer, or a hub id."
            ) from None
        if self.model.config.num_labels != 1:
            raise UserError(
                f"--reward-model {path_or_id!r} has {self.model.config.num_labels} outputs; a reward model "
                "has one, its score for the text (num_labels=1 in its config)."
            )
        self.batch_size = batch_size
        # pad with EOS (the score is read at the last non-pad token)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
            # nothing to pad with
            self.batch_size = batch_size if self.tokenizer.pad_token is not None else 1
        # keep the end of long texts
        self.tokenizer.padding_side, self.tokenizer.truncation_side = (
            "right",
            "left",
        )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        limits = [
            n
            for n in (
                self.tokenizer.model_max_length,
                getattr(self.model.config, "max_position_embeddings", None),
            )
            if n and n < 10**9
        ]
        self.max_length = min(limits) if limits else None
        self.model.to(device).eval().requires_grad_(False)

    def text(self, prompt, response):
        if getattr(self.tokenizer, "chat_template", None) is None:
            return f"{prompt}\n{response}"
        chat = [
            {"role": "user", "content": str(prompt)},
            {"role": "assistant", "content": response},
        ]
        return self.tokenizer.apply_chat_template(chat, tokenize=False)

    @torch.no_grad()
    def __call__(self, completions, answers, prompts):
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[i : i + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
                add_special_tokens=getattr(self.tokenizer, "chat_template", None) is None,
            )
            device = next(self.model.parameters()).device
            scores += self.model(**batch.to(device)).logits[:, 0].float().tolist()
        return scores
