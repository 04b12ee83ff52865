"""Real trl (not a replica): GRPOTrainer's (or RLOOTrainer's) own training loop on a tiny Llama
built from a config, a word-level tokenizer built in memory and an in-memory dataset, offline on CPU.

num_iterations=2: each generated batch is trained on twice, so the same `inputs` dict (advantages,
old log-probs, masks) reaches the loss twice. The job's custom loss scales the advantages; with
--bug it does so in place, so the second pass trains on advantages scaled twice. --beta 0.04: a
KL term against a reference model that trl loads from the saved policy and blends toward it every
step (sync_ref_model), so the batch holds ref_per_token_logps too.
Prints the trainer's own logged losses."""

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets
import torch
from _tiny_llama import tiny_llama, tokenizer
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

ADVANTAGE_SCALE = 0.5


def reward_vowels(completions, **kwargs):
    """A Python reward: the share of vowels in each completion."""
    return [sum(c in "aeiou" for c in text.split()) / max(len(text.split()), 1) for text in completions]


def scaled(trainer: type) -> type:
    class ScaledAdvantages(trainer):
        """A custom loss that scales the advantages before the trainer's clipped objective."""

        bug = False

        def _compute_loss(self, model, inputs):
            if self.bug:
                advantages = inputs["advantages"]
                advantages *= ADVANTAGE_SCALE  # the bug: the buffered batch's tensor, trained on again next iteration
            else:
                inputs = {**inputs, "advantages": inputs["advantages"] * ADVANTAGE_SCALE}
            return super()._compute_loss(model, inputs)

    return ScaledAdvantages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["grpo", "rloo"], default="grpo")
    parser.add_argument("--bug", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.0)
    opts = parser.parse_args()
    torch.manual_seed(0)
    datasets.disable_progress_bars()
    tok = tokenizer()
    model = tiny_llama(tok)
    prompts = datasets.Dataset.from_dict({"prompt": ["a b c", "d e f", "g h i", "j k l"] * 4})
    config, trainer = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}[opts.trainer]
    args = config(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, num_generations=4, max_completion_length=4,
        num_iterations=2, beta=opts.beta, sync_ref_model=opts.beta > 0, ref_model_sync_steps=1, max_steps=opts.steps,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
        seed=0, data_seed=0)
    if opts.beta > 0:  # trl builds the reference model from a path (its config's name)
        model.save_pretrained(path := tempfile.mkdtemp())
        model = path
    job = scaled(trainer)(model=model, processing_class=tok, reward_funcs=reward_vowels, args=args,
                          train_dataset=prompts)
    job.bug = opts.bug
    job.train()
    for entry in job.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']} loss {entry['loss']:.4f}")


if __name__ == "__main__":
    main()
