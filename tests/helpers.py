"""Small assertion helpers shared by the tests."""

import torch


def assert_close(actual: torch.Tensor, expected, rtol: float = 1e-6, atol: float = 1e-6) -> None:
    """Compare a tensor with a (nested) list of expected numbers, printing both on failure."""
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, rtol=rtol, atol=atol)


def build_tiny_llama(folder, seed: int = 0):
    """Save a random-weight Llama-style causal LM (grouped-query attention, RoPE, SwiGLU) with a
    byte-level BPE tokenizer to ``folder``, as ``save_pretrained`` writes a downloaded one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppo_core.modeling.review_grammar import generate_review_corpus
    from ppo_core.modeling.tiny_default import train_tokenizer

    tokenizer = train_tokenizer(generate_review_corpus(500, seed=seed), vocab_size=512)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
