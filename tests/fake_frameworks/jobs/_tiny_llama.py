"""What the trl jobs share: a word-level tokenizer built in memory and a tiny Llama from a config
(random weights, no download), so trl's trainers run offline on CPU."""

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz"]


def tokenizer() -> PreTrainedTokenizerFast:
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None))
