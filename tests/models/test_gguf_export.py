"""`ppo export`: a model written as GGUF loads back with transformers' own GGUF loader to the
same greedy tokens and the same tokenization, chat template included (f32: the same logits
exactly; f16: exactly the model with its matrices rounded to f16; q8_0: the first difference,
if any, is a near tie), for every architecture the exporter writes; what it cannot write is
refused in one line before a byte is written."""

from __future__ import annotations

import pytest
import torch

from ppo_core.models.gguf_export import GGUFExportError, export_gguf
from tests.helpers import CHAT_TEMPLATE, build_tiny_causal_lm

PROMPTS = ["the film was", "a great movie 123 and", "worst acting ever, but"]
CHATS = [
    [{"role": "user", "content": "Review the film in one line."}],
    [
        {"role": "system", "content": "You are a critic."},
        {"role": "user", "content": "Was it good?"},
    ],
]


def load_folder(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def load_gguf(path, **config):
    """transformers' own GGUF load: the consumer the file must satisfy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **config
    )
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def gguf_config(model) -> dict:
    # transformers' GGUF loader reads gpt2.context_length into n_ctx, not n_positions: a GPT-2
    # file of any context but 1024 loads only with n_positions given
    return {"n_positions": model.config.n_positions} if model.config.model_type == "gpt2" else {}


def greedy(model, ids, tokens: int = 12) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            ids, do_sample=False, max_new_tokens=tokens, pad_token_id=0, eos_token_id=None
        )
    return out[0, ids.shape[1] :].tolist()


def first_difference(reference, other, ids, tokens: int = 12) -> dict | None:
    """None when both greedy continuations agree; else the position and each model's token
    with the reference's log-probability of both."""
    ours, theirs = greedy(reference, ids, tokens), greedy(other, ids, tokens)
    for position, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            context = torch.tensor([ids[0].tolist() + ours[:position]])
            with torch.no_grad():
                logprobs = reference(context).logits[0, -1].log_softmax(-1)
            return {
                "position": position,
                "reference": (a, logprobs[a].item()),
                "other": (b, logprobs[b].item()),
            }
    return None


def rounded_to_f16(model):
    """The model with every matrix rounded to f16 and back (what an f16 file stores; vectors
    stay f32, as the file keeps them)."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim >= 2:
                parameter.copy_(parameter.half().float())
    return model


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    from ppo_core.base_sources.tiny_default import build_tiny_default

    folders = {
        family: build_tiny_causal_lm(root / family, family, chat_template=CHAT_TEMPLATE)
        for family in ("llama", "qwen2", "mistral")
    }
    folders["gpt2"] = build_tiny_default(root / "gpt2", seed=0, steps=30)
    return folders


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_an_f32_export_loads_back_to_the_same_logits_tokens_and_chat_rendering(
    tiny_models, tmp_path, family
):
    model, tokenizer = load_folder(tiny_models[family])
    path = tmp_path / "model.gguf"
    summary = export_gguf(model, tokenizer, path, "f32", name=f"tiny {family}")
    assert summary.tensor_types == {"F32": summary.tensor_types["F32"]}
    loaded, loaded_tokenizer = load_gguf(path, **gguf_config(model))
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert loaded_tokenizer(prompt, return_tensors="pt").input_ids.tolist() == ids.tolist()
        with torch.no_grad():
            gap = (model(ids).logits - loaded(ids).logits).abs().max().item()
        # Llama, Qwen2, Mistral: 0.0 exactly; GPT-2 1.4e-6 (its fused attention is computed
        # from the split halves of one matrix in another order)
        assert gap <= (3e-6 if family == "gpt2" else 0.0), gap
        assert greedy(loaded, ids) == greedy(model, ids), prompt
    if family != "gpt2":  # the tiny default has no chat template
        assert loaded_tokenizer.chat_template == CHAT_TEMPLATE
        for chat in CHATS:
            ours = tokenizer.apply_chat_template(chat, add_generation_prompt=True)
            theirs = loaded_tokenizer.apply_chat_template(chat, add_generation_prompt=True)
            assert theirs == ours


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_f16_and_q8_0_exports_are_the_rounded_model_and_a_near_tie_at_most(
    tiny_models, tmp_path, family
):
    model, tokenizer = load_folder(tiny_models[family])
    export_gguf(model, tokenizer, tmp_path / "f16.gguf", "f16")
    summary = export_gguf(model, tokenizer, tmp_path / "q8.gguf", "q8_0")
    assert set(summary.tensor_types) == {"F32", "Q8_0"}  # rows of 32, 64, 128: all in blocks
    f16, _ = load_gguf(tmp_path / "f16.gguf", **gguf_config(model))
    q8, _ = load_gguf(tmp_path / "q8.gguf", **gguf_config(model))
    rounded = rounded_to_f16(load_folder(tiny_models[family])[0])
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gap = (rounded(ids).logits - f16(ids).logits).abs().max().item()
        assert gap <= (3e-6 if family == "gpt2" else 0.0), gap  # measured 0.0 / 1.4e-6
        assert greedy(f16, ids) == greedy(rounded, ids)
        difference = first_difference(model, q8, ids)
        if difference is not None:
            # random tiny weights have near-uniform logits; a q8_0 difference must be a near
            # tie of the two tokens under the exported model (measured gaps below 0.05 nats)
            (_, ours), (_, theirs) = difference["reference"], difference["other"]
            assert ours - theirs < 0.1, difference


def test_what_the_exporter_cannot_write_is_refused_before_a_byte_is_written(tiny_models, tmp_path):
    model, tokenizer = load_folder(tiny_models["llama"])
    path = tmp_path / "model.gguf"
    with pytest.raises(GGUFExportError, match="export.type='q4_k'"):
        export_gguf(model, tokenizer, path, "q4_k")
    neox = build_tiny_causal_lm(tmp_path / "neox", "gpt_neox")
    neox_model, neox_tokenizer = load_folder(neox)
    with pytest.raises(GGUFExportError, match="model type 'gpt_neox' cannot be exported"):
        export_gguf(neox_model, neox_tokenizer, path, "f16")
    model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    with pytest.raises(GGUFExportError, match="rope_type='llama3'"):
        export_gguf(model, tokenizer, path, "f16")
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".*")) == []
    path.write_bytes(b"someone else's file")
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(FileExistsError, match="an export never replaces a file"):
        export_gguf(model, tokenizer, path, "f16")
    assert path.read_bytes() == b"someone else's file"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_the_end_of_text_and_end_of_turn_ids_in_the_file_are_the_models(tiny_models, tmp_path):
    """llama.cpp ends a reply at the file's EOS and EOT ids: read back from the file, they are
    the tokenizer's EOS and the other stop id the generation config lists (a chat model's end
    of turn)."""
    import gguf

    model, tokenizer = load_folder(tiny_models["llama"])
    end_of_turn = next(i for i in range(3, 50) if i != tokenizer.eos_token_id)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    path = tmp_path / "model.gguf"
    export_gguf(model, tokenizer, path, "f32")
    reader = gguf.GGUFReader(path)

    def written(key: str) -> int:
        field = reader.fields[key]
        return int(field.parts[field.data[0]][0])

    assert written("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert written("tokenizer.ggml.eot_token_id") == end_of_turn
    assert written("tokenizer.ggml.bos_token_id") == tokenizer.bos_token_id
