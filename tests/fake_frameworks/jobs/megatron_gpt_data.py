"""Real megatron-core (not a replica): its GPTDataset over a small IndexedDataset written on disk,
built as a trainer builds it; reads a few samples and prints their loss masks. The pad id is the
EOD id, as in Megatron-LM !4164."""

import os
import sys
import tempfile

import numpy as np
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

EOD = 0


class Tokenizer:  # what GPTDataset reads of a MegatronTokenizer
    eod = EOD
    pad = EOD
    vocab_size = 32
    unique_identifiers = {"class": "Tokenizer"}


def main() -> None:
    root = tempfile.mkdtemp()
    prefix = os.path.join(root, "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(16):
        builder.add_document(torch.from_numpy(np.append(rng.integers(1, 32, 5), EOD).astype(np.int32)), [6])
    builder.finalize(prefix + ".idx")
    config = GPTDatasetConfig(random_seed=1, sequence_length=8, blend=([prefix], None), split="1,0,0",
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              tokenizer=Tokenizer(), mid_level_dataset_surplus=0.005)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [6, 0, 0], lambda: True, config).build()
    for i in range(3):
        print(type(train).__name__, i, train[i]["loss_mask"].tolist())


if __name__ == "__main__":
    main()
