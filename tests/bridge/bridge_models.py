"""Tiny random-weight models of every supported family (built offline from configs).

A uniquely named module (not conftest) so test files can import it unambiguously.
"""

from __future__ import annotations

import torch
import transformers as T

_COMMON = dict(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
)
_SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _configs() -> dict[str, object]:
    return {
        "gpt2": T.GPT2Config(
            vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128, **_SPECIAL_IDS
        ),
        "llama": T.LlamaConfig(**_COMMON, **_SPECIAL_IDS),
        "mistral": T.MistralConfig(**_COMMON, sliding_window=4, **_SPECIAL_IDS),
        "qwen2": T.Qwen2Config(**_COMMON, **_SPECIAL_IDS),
        "qwen3": T.Qwen3Config(**_COMMON, head_dim=16, **_SPECIAL_IDS),
        "gemma": T.GemmaConfig(**_COMMON, head_dim=16, **_SPECIAL_IDS),
        "gemma2": T.Gemma2Config(**_COMMON, head_dim=16, sliding_window=4, **_SPECIAL_IDS),
        "gemma3_text": T.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=4, **_SPECIAL_IDS),
        "phi3": T.Phi3Config(**_COMMON, **_SPECIAL_IDS),
        "gpt_neox": T.GPTNeoXConfig(
            vocab_size=1000,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=128,
            **_SPECIAL_IDS,
        ),
        "opt": T.OPTConfig(
            vocab_size=1000,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=128,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            **_SPECIAL_IDS,
        ),
        "mixtral": T.MixtralConfig(
            **_COMMON, num_local_experts=4, num_experts_per_tok=2, **_SPECIAL_IDS
        ),
        "qwen3_moe": T.Qwen3MoeConfig(
            **_COMMON,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            **_SPECIAL_IDS,
        ),
        "qwen2_moe": T.Qwen2MoeConfig(  # layer 0 routed experts and a shared expert, 1 dense
            **_COMMON,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=96,
            mlp_only_layers=[1],
            **_SPECIAL_IDS,
        ),
        "gpt_oss": T.GptOssConfig(
            **_COMMON,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            **_SPECIAL_IDS,
        ),
    }


ARCHS = list(_configs())
MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]
_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(arch: str) -> torch.nn.Module:
    """A cached tiny fp32 model in eval mode, shared by the tests of a process: they must not
    modify its weights nor leave PyTorch hooks on it (``tests/bridge/conftest.py`` checks)."""
    if arch not in _MODELS:
        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(_configs()[arch]).eval()
        if arch == "gpt_oss":  # sinks start at zero; make them matter
            for layer in model.model.layers:
                torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
        _MODELS[arch] = model
    return _MODELS[arch]


def drop_hooked_models() -> list[str]:
    """Remove from the cache every model that carries a PyTorch hook (the next ``tiny_model``
    call builds it afresh); return their hooked modules as ``arch:module``."""
    hooked = {
        arch: [
            f"{arch}:{name or '<root>'}"
            for name, m in model.named_modules()
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
        ]
        for arch, model in _MODELS.items()
    }
    for arch, modules in hooked.items():
        if modules:
            del _MODELS[arch]
    return [m for modules in hooked.values() for m in modules]


def make_word_tokenizer(prepend_bos: bool = False) -> T.PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with <pad>=0, <bos>=1, <eos>=2; with ``prepend_bos``
    it adds <bos> to every text itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = [
        "<pad>",
        "<bos>",
        "<eos>",
        "<unk>",
        *"the cat sat on mat a dog ran to park and".split(),
    ]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if prepend_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 1)]
        )
    return T.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
