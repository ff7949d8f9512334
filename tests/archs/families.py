"""The architecture matrix's families: tiny random targets built from transformers configs (no downloads).

Each `Family` builds a config of one decoder-only family at smoke scale (hidden 32, 4 layers: two
taps by the derived rule; 4 heads) with the family's own features kept: Mistral's sliding window,
Gemma's scaled embedding and per-layer-type rope, GPT-2's `n_embd` spellings and tied
`transformer.wte`, GPT-NeoX's `embed_in` / `embed_out` and partial rotary, gpt-oss's sinks and
experts, the Gated DeltaNet layers of Qwen3-Next and Qwen3.5, DeepSeek-V3's MLA, Cohere's logit
scale, Granite's multipliers, SmolLM3's NoPE layers, Falcon-H1's `lm_head_multiplier` and Mamba-2
mixers, Llama-4 text's decoder reached below `get_decoder()`, LFM2's and XGLM's final norms by their
names. Families the installed transformers lacks are skipped by name; `REFUSED` families cannot be
DFlash targets and must be refused by the drafter command before it writes or runs anything, in one
line: by the architecture check (encoder-decoder, widths, a head bias, no attention, stacked streams)
or by the target's self-check (a forward through the cache that differs from the full recompute, or
fails).
"""

from __future__ import annotations

import dataclasses

import transformers

WIDTH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
HEAD = dict(head_dim=8)


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of the matrix: `config_class` (a transformers name) built with `kwargs` and the token ids."""

    name: str
    config_class: str
    kwargs: dict
    refused: str | None = None  # the refusal's reason (a phrase of the one-line error), for REFUSED families
    seq2seq: bool = False  # built with AutoModelForSeq2SeqLM (an encoder-decoder, refused)

    @property
    def available(self) -> bool:
        return hasattr(transformers, self.config_class)

    def config(self, vocab_size: int, token_ids: dict):
        return getattr(transformers, self.config_class)(vocab_size=vocab_size, **token_ids, **self.kwargs)


def _family(name: str, config_class: str, **kwargs) -> Family:
    return Family(name, config_class, kwargs)


FAMILIES: tuple[Family, ...] = (
    _family("Llama", "LlamaConfig", **WIDTH, **HEAD),
    _family("Qwen2", "Qwen2Config", **WIDTH),
    _family("Qwen3", "Qwen3Config", **WIDTH, **HEAD),
    _family(
        "Qwen3-MoE",
        "Qwen3MoeConfig",
        **WIDTH,
        **HEAD,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    _family("Mistral (sliding window 8)", "MistralConfig", **WIDTH, **HEAD, sliding_window=8),
    _family("Gemma2", "Gemma2Config", **WIDTH, **HEAD, sliding_window=8),
    _family("Gemma3", "Gemma3TextConfig", **WIDTH, **HEAD, sliding_window=8),
    _family(
        "Gemma4",
        "Gemma4TextConfig",
        **WIDTH,
        **HEAD,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        num_kv_shared_layers=0,
    ),
    _family("Phi3", "Phi3Config", **WIDTH),
    _family("OLMo2", "Olmo2Config", **WIDTH),
    _family("GPT-NeoX", "GPTNeoXConfig", **{k: v for k, v in WIDTH.items() if k != "num_key_value_heads"}),
    _family("GPT-2", "GPT2Config", n_embd=32, n_layer=4, n_head=4, n_positions=256),
    _family(
        "gpt-oss",
        "GptOssConfig",
        **WIDTH,
        **HEAD,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
    ),
    _family(
        "Qwen3-Next",
        "Qwen3NextConfig",
        **WIDTH,
        **HEAD,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
    _family(
        "Qwen3.5",
        "Qwen3_5TextConfig",
        **WIDTH,
        **HEAD,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    ),
    _family(
        "DeepSeek-V3 (MLA)",
        "DeepseekV3Config",
        **{k: v for k, v in WIDTH.items() if k != "num_key_value_heads"},
        num_key_value_heads=4,
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    ),
    _family("Granite", "GraniteConfig", **WIDTH, embedding_multiplier=12.0, logits_scaling=8.0),
    _family("Cohere", "CohereConfig", **WIDTH, logit_scale=0.25),
    _family("SmolLM3", "SmolLM3Config", **WIDTH, no_rope_layer_interval=3),
    _family(
        "Falcon-H1 (Mamba-2 + attention, lm_head_multiplier)",
        "FalconH1Config",
        **WIDTH,
        **HEAD,
        mamba_d_ssm=32,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=8,
        lm_head_multiplier=0.5,
    ),
    _family(
        "GraniteMoeHybrid (Mamba-2 layers)",
        "GraniteMoeHybridConfig",
        **WIDTH,
        num_local_experts=2,
        num_experts_per_tok=1,
        shared_intermediate_size=32,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=8,
        layer_types=["mamba", "attention", "mamba", "attention"],
    ),
    _family(
        "Llama-4 text (get_decoder() is the causal LM)",
        "Llama4TextConfig",
        **WIDTH,
        **HEAD,
        num_local_experts=2,
        num_experts_per_tok=1,
        intermediate_size_mlp=64,
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 1, 1, 0],
        attention_chunk_size=8,
    ),
    _family("LFM2 (final norm `embedding_norm`)", "Lfm2Config", **WIDTH, layer_types=["conv", "full_attention"] * 2),
    _family(
        "XGLM (final norm `layer_norm`)",
        "XGLMConfig",
        d_model=32,
        ffn_dim=64,
        num_layers=4,
        attention_heads=4,
        max_position_embeddings=1024,
    ),
)

REFUSED: tuple[Family, ...] = (
    Family(
        "T5 (encoder-decoder)",
        "T5Config",
        dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8),
        refused="encoder-decoder",
        seq2seq=True,
    ),
    Family(
        "OPT-350m style (embedding narrower than hidden)",
        "OPTConfig",
        dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=16),
        refused="token embedding is 16 wide",
    ),
    Family(
        "Phi (output head with a bias)",
        "PhiConfig",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4),
        refused="output head has a bias",
    ),
    Family(
        "Mamba-2 (recurrent only)",
        "Mamba2Config",
        dict(hidden_size=32, num_hidden_layers=4, num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=8),
        refused="no attention layers",
    ),
    Family(
        "Gemma-3n (stacked streams)",
        "Gemma3nTextConfig",
        dict(
            **WIDTH,
            **HEAD,
            sliding_window=8,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=512,
            laurel_rank=4,
            num_kv_shared_layers=0,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            activation_sparsity_pattern=[0.0] * 4,
        ),
        refused="stacked streams",
    ),
    Family(
        "Jamba (cache differs from the full forward)",
        "JambaConfig",
        dict(
            **WIDTH,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=8,
            mamba_dt_rank=4,
            initializer_range=0.05,  # activations nearer a trained model's: the cache's error is 2e-2, not 6e-5
        ),
        refused="block through its cache differs",
    ),
    Family(
        "MiniMax (cache differs from the full forward)",
        "MiniMaxConfig",
        dict(
            **WIDTH,
            **HEAD,
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=["linear_attention", "full_attention"] * 2,
            block_size=8,
        ),
        refused="block through its cache differs",
    ),
    Family(
        "Bamba (cache differs from the full forward)",
        "BambaConfig",
        dict(
            **WIDTH,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
            attn_layer_indices=[1, 3],
        ),
        refused="block through its cache differs",
    ),
    Family(
        "RecurrentGemma (no cache to verify through)",
        "RecurrentGemmaConfig",
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            lru_width=32,
            attention_window_size=8,
            block_types=["recurrent", "recurrent", "attention"],
        ),
        refused="forward through a cache fails",
    ),
)

ALL: tuple[Family, ...] = FAMILIES + REFUSED


def by_name(name: str) -> Family:
    return next(f for f in ALL if f.name == name)
