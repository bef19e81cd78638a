"""Held-out questions beyond --task multiplication's operands, for the calculator task.

    python -m scripts.tool_heldout --model DIR [--operands 4x3] [any trainer.py flag]

evaluates --model (a base model, or a run's checkpoint directory: RUN/checkpoint) as `trainer.py
--task multiplication --tool calculator --eval-only` does, with the task's prompt, reward, budget
and evaluation settings (100 questions x 8 samples at T = 0.7, --eval-seed 0), on
"What is A x B?" with A and B of the --operands' digit counts (data.larger_multiplication_rows,
seed data.LARGER_SEED; 4 x 3 digits by default, where the task trains on 3 x 2). The other flags
(--eval-seed, --max-new-tokens, --eval-limit, ...) are trainer.py's. docs/tools.md has the numbers.
"""

import functools
import re
import sys

import config
import data
import trainer
from support import models
from support.errors import UserError


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    digits = (4, 3)
    if "--operands" in argv:
        i = argv.index("--operands")
        value = argv[i + 1] if i + 1 < len(argv) else ""
        match = re.fullmatch(r"([1-9])x([1-9])", value)
        if match is None:
            raise SystemExit(
                f"error: --operands takes AxB, digit counts 1-9 (e.g. 4x3); got {value!r}"
            )
        digits = (int(match[1]), int(match[2]))
        del argv[i : i + 2]
    try:
        args = config.parse_args(
            ["--task", "multiplication", "--tool", "calculator", "--eval-only", *argv]
        )
        rows = data.larger_multiplication_rows(digits)
        task = trainer.load_task(args, data.multiplication_task(True, eval_rows=rows))
        print(f"held-out: {digits[0]}-digit x {digits[1]}-digit products, seed {data.LARGER_SEED}")
        fits = functools.partial(models.check_context, args.max_new_tokens, args.max_prompt_length)
        model, tokenizer = models.load_model(args.model, args.trust_remote_code, check_config=fits)
        return trainer.evaluate_only(args, task, model, tokenizer, None)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
