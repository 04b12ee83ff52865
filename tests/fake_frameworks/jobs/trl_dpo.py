"""Real trl (not a replica): DPOTrainer's own training loop on a tiny Llama built from a config
(and an explicit reference copy), a word-level tokenizer built in memory and an in-memory
preference dataset, offline on CPU. --precompute: the reference log-probs are computed before
training and ride in each batch (`ref_chosen_logps`, `ref_rejected_logps`); the job's custom loss
subtracts a margin from them (on a copy). Prints the trainer's own logged metrics."""

import argparse
import copy
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets
import torch
from _tiny_llama import tiny_llama, tokenizer
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

REFERENCE_SHIFT = 0.1


class MarginTrainer(DPOTrainer):
    """A custom loss that asks the chosen completion to beat the reference by a margin."""

    def _compute_loss(self, model, inputs, return_outputs):
        if "ref_chosen_logps" in inputs:
            inputs = {**inputs, "ref_chosen_logps": inputs["ref_chosen_logps"] - REFERENCE_SHIFT}
        return super()._compute_loss(model, inputs, return_outputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precompute", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    opts = parser.parse_args()
    torch.manual_seed(0)
    datasets.disable_progress_bars()
    tok = tokenizer()
    model = tiny_llama(tok)
    ref_model = copy.deepcopy(model)
    pairs = Dataset.from_dict({"prompt": ["a b c", "d e f", "g h i", "j k l"] * 2,
                               "chosen": [" a e", " i o", " u a", " e i"] * 2,
                               "rejected": [" x y", " z q", " w v", " t s"] * 2})
    args = DPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=opts.steps, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        precompute_ref_log_probs=opts.precompute)
    trainer = MarginTrainer(model=model, ref_model=ref_model, processing_class=tok, args=args, train_dataset=pairs)
    trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']} loss {entry['loss']:.4f} rewards/margins {entry['rewards/margins']:.4f}")


if __name__ == "__main__":
    main()
