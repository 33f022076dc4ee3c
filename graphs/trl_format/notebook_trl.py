"""graphs/trl_format/notebook.py's run written for TRL's GRPOTrainer (TRL 1.16), for the
README's side-by-side: the same DataFrame, the same reward function, the same model and
settings. Not a flowgraph dependency; run it where TRL is installed:

    python graphs/trl_format/notebook_trl.py MODEL     # in a venv with trl==1.16

MODEL is the folder of builtin:tiny-lm-sft, which this prints where flowgraph is installed:
    python -c "from flowgraph.compilers import builtin_training as b; \
        print(b.ensure_builtin('tiny-lm-sft'))"
"""

import random
import re
import sys

import pandas as pd
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

rng = random.Random(0)
numbers = [str(rng.randrange(100, 10000)) for _ in range(64)]  # 3-4 digits
df = pd.DataFrame({
    "prompt": [[{"role": "user", "content": f"reverse {n}"}] for n in numbers],
    "solution": [n[::-1] for n in numbers],
})


def correct(completions, solution, **kwargs):
    """1 when the reply's last number is the row's solution, else 0."""
    last = [(re.findall(r"\d+", c[0]["content"]) or [None])[-1] for c in completions]
    return [float(a == s) for a, s in zip(last, solution, strict=True)]


args = GRPOConfig(
    output_dir="runs/grpo_notebook_trl", max_steps=100, logging_steps=20, report_to="none",
    per_device_train_batch_size=128, num_generations=8,  # 16 prompts x 8 per step
    max_completion_length=8, temperature=1.0, beta=0.0,
    learning_rate=3e-4, warmup_steps=2, lr_scheduler_type="linear",
    use_cpu=True, bf16=False, seed=0, save_strategy="no")
trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=correct, args=args,
                      train_dataset=Dataset.from_pandas(df))
trainer.train()
trainer.save_model("runs/grpo_notebook_trl-hf")
