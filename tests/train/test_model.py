"""The drafter against transformers' Qwen3 / Qwen3.5 reference code, against a from-the-spec
re-derivation of docs/dflash.md "Drafter", and its config and parameter names."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from train.attention import build_dense_mask
from train.config import ModelConfig
from train.drafter_config import DrafterConfig, rope_settings
from train.model import DecoderLayer, DFlashDrafter, RotaryEmbedding, TargetHead, apply_rotary

# The Qwen3.6-27B text config , trimmed to what the drafter reads.
QWEN36_TEXT = {
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 248320,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "initializer_range": 0.02,
    "partial_rotary_factor": 0.25,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
}


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=40,
        target_layer_ids=[0, 2],
        num_target_layers=4,
        mask_token_id=39,
        block_size=4,
        rope_theta=10000.0,
    )
    values.update(overrides)
    return DrafterConfig(**values)


def test_one_layer_equals_transformers_qwen3_decoder_layer():
    """No context tokens + a causal mask: a drafter layer is exactly a Qwen3 decoder layer."""
    torch.manual_seed(1)
    hf_cfg = Qwen3Config(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=40,
    )
    hf_cfg._attn_implementation = "eager"
    reference = Qwen3DecoderLayer(hf_cfg, layer_idx=0).eval()
    for p in reference.parameters():  # norms start at 1: randomize them so a missing norm shows
        torch.nn.init.normal_(p, std=0.3 if p.ndim == 2 else 1.0)
    ours = DecoderLayer(tiny_config()).eval()
    missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=True)
    assert not missing and not unexpected

    B, T = 2, 7
    x = torch.randn(B, T, 32)
    positions = torch.arange(T).expand(B, T) + torch.tensor([[0], [5]])  # absolute, different per row
    cos, sin = Qwen3RotaryEmbedding(hf_cfg)(x, positions)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    additive = torch.zeros(B, 1, T, T).masked_fill(~causal, float("-inf"))
    expected = reference(x, attention_mask=additive, position_ids=positions, position_embeddings=(cos, sin))
    expected = expected[0] if isinstance(expected, tuple) else expected

    our_cos, our_sin = RotaryEmbedding(tiny_config())(positions, torch.float32)
    torch.testing.assert_close(our_cos, cos)
    got = ours(x, torch.zeros(B, 0, 32), our_cos, our_sin, causal.expand(B, 1, T, T))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_partial_rotary_matches_qwen3_5_for_the_27b_rope():
    """Qwen3.6: theta 1e7, 64 of 256 head dims rotated; text-only M-RoPE is plain RoPE."""
    theta, scaling, factor = rope_settings(QWEN36_TEXT)
    assert (theta, scaling, factor) == (1e7, None, 0.25)
    cfg = tiny_config(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        rope_theta=theta,
        partial_rotary_factor=factor,
    )
    hf_cfg = Qwen3_5TextConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        rope_parameters=dict(QWEN36_TEXT["rope_parameters"]),
    )
    positions = torch.tensor([[0, 1, 2, 3000, 70000]])
    # Text-only M-RoPE: the three position streams (t, h, w) are equal. transformers 5.17 takes them only
    # as [3, batch, T]; later versions also broadcast [batch, T]. Both get the same numbers from [3, batch, T].
    streams = positions[None].expand(3, -1, -1)
    ref_cos, ref_sin = modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), streams)
    cos, sin = RotaryEmbedding(cfg)(positions, torch.float32)
    assert cos.shape[-1] == 64
    torch.testing.assert_close(cos, ref_cos)
    torch.testing.assert_close(sin, ref_sin)
    q = torch.randn(1, 2, 5, 256)
    k = torch.randn(1, 2, 5, 256)
    ref_q, ref_k = modeling_qwen3_5.apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k)
    assert torch.equal(apply_rotary(q, cos, sin)[..., 64:], q[..., 64:])  # the other 192 dims pass through


def test_yarn_scaling_matches_transformers():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    cfg = tiny_config(rope_theta=1e6, rope_scaling=scaling, max_position_embeddings=16384)
    hf_cfg = Qwen3Config(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=8,
        max_position_embeddings=16384,
        rope_parameters={"rope_theta": 1e6, **scaling},
    )
    positions = torch.tensor([[0, 7, 5000, 12000]])
    ref_cos, ref_sin = Qwen3RotaryEmbedding(hf_cfg)(torch.zeros(1), positions)
    cos, sin = RotaryEmbedding(cfg)(positions, torch.float32)
    torch.testing.assert_close(cos, ref_cos)
    torch.testing.assert_close(sin, ref_sin)
    assert not torch.allclose(cos, RotaryEmbedding(tiny_config(rope_theta=1e6))(positions, torch.float32)[0])


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, rot):
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2).float() / rot))
    ang = pos[..., None].float() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    xr, xp = x[..., :rot], x[..., rot:]
    a, b = xr.chunk(2, -1)
    return torch.cat([xr * cos + torch.cat([-b, a], -1) * sin, xp], -1)


def _spec_forward(model: DFlashDrafter, noise, target_hidden, position_ids):
    """docs/dflash.md "Drafter" written out with plain tensor ops, no mask (everything visible)."""
    cfg = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    S = target_hidden.shape[1]
    B, Q, _ = noise.shape
    H, G, E, R = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    c = _rms(target_hidden.float() @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    h = noise
    for i in range(cfg.num_hidden_layers):
        p = lambda n, i=i: sd[f"layers.{i}.{n}"]  # noqa: E731
        x = _rms(h, p("input_layernorm.weight"))
        q = _rms((x @ p("self_attn.q_proj.weight").T).view(B, Q, H, E), p("self_attn.q_norm.weight")).transpose(1, 2)
        k = torch.cat([c @ p("self_attn.k_proj.weight").T, x @ p("self_attn.k_proj.weight").T], 1)
        v = torch.cat([c @ p("self_attn.v_proj.weight").T, x @ p("self_attn.v_proj.weight").T], 1)
        k = _rms(k.view(B, S + Q, G, E), p("self_attn.k_norm.weight")).transpose(1, 2)
        v = v.view(B, S + Q, G, E).transpose(1, 2)
        q = _rope(q, position_ids[:, S:], cfg.rope_theta, R)
        k = _rope(k, position_ids, cfg.rope_theta, R)
        k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(E), -1) @ v
        h = h + att.transpose(1, 2).reshape(B, Q, H * E) @ p("self_attn.o_proj.weight").T
        y = _rms(h, p("post_attention_layernorm.weight"))
        h = (
            h
            + (torch.nn.functional.silu(y @ p("mlp.gate_proj.weight").T) * (y @ p("mlp.up_proj.weight").T))
            @ p("mlp.down_proj.weight").T
        )
    return _rms(h, sd["norm.weight"])


def test_drafter_forward_equals_the_spec_written_out():
    torch.manual_seed(2)
    cfg = tiny_config(partial_rotary_factor=0.5)
    model = DFlashDrafter(cfg)
    for n, p in model.named_parameters():
        if "norm" in n:
            torch.nn.init.normal_(p, 1.0, 0.2)
    B, S, Q = 2, 9, 8
    noise, hidden = torch.randn(B, Q, 32), torch.randn(B, S, cfg.feature_width).bfloat16()
    positions = torch.cat([torch.arange(S).expand(B, S), torch.tensor([[9, 10, 11, 12, 3, 4, 5, 6]] * B)], 1)
    with torch.no_grad():
        got = model(noise, hidden, positions, None)
    torch.testing.assert_close(got, _spec_forward(model, noise, hidden, positions), rtol=1e-4, atol=1e-4)


def test_context_at_or_after_the_anchor_and_other_blocks_are_invisible():
    torch.manual_seed(3)
    cfg = tiny_config()
    model = DFlashDrafter(cfg).eval()
    B, S, K = 1, 12, 4
    anchors, keep = torch.tensor([[3, 7]]), torch.tensor([[True, True]])
    positions = torch.cat([torch.arange(S)[None], (anchors[:, :, None] + torch.arange(K)).view(1, -1)], 1)
    mask = build_dense_mask(anchors, keep, S, K)
    noise, hidden = torch.randn(B, 2 * K, 32), torch.randn(B, S, cfg.feature_width)
    with torch.no_grad():
        base = model(noise, hidden, positions, mask)
        changed = hidden.clone()
        changed[:, 3:] += 5.0  # positions >= anchor 3: invisible to block 0, partly visible to block 1
        out = model(noise, changed, positions, mask)
        assert torch.equal(out[:, :K], base[:, :K])
        assert not torch.allclose(out[:, K:], base[:, K:])
        other = noise.clone()
        other[:, K:] += 1.0  # block 1's tokens: invisible to block 0
        assert torch.equal(model(other, hidden, positions, mask)[:, :K], base[:, :K])
        earlier = hidden.clone()
        earlier[:, 2] += 5.0  # before both anchors: both blocks see it
        out = model(noise, earlier, positions, mask)
        assert not torch.allclose(out[:, :K], base[:, :K]) and not torch.allclose(out[:, K:], base[:, K:])


def test_published_parameter_names_and_shapes():
    cfg = tiny_config(num_hidden_layers=2)
    names = {n: tuple(p.shape) for n, p in DFlashDrafter(cfg).state_dict().items()}
    expected = {"fc.weight": (32, 64), "hidden_norm.weight": (32,), "norm.weight": (32,)}
    for i in range(2):
        expected.update(
            {
                f"layers.{i}.input_layernorm.weight": (32,),
                f"layers.{i}.post_attention_layernorm.weight": (32,),
                f"layers.{i}.self_attn.q_proj.weight": (32, 32),
                f"layers.{i}.self_attn.k_proj.weight": (16, 32),
                f"layers.{i}.self_attn.v_proj.weight": (16, 32),
                f"layers.{i}.self_attn.o_proj.weight": (32, 32),
                f"layers.{i}.self_attn.q_norm.weight": (8,),
                f"layers.{i}.self_attn.k_norm.weight": (8,),
                f"layers.{i}.mlp.gate_proj.weight": (48, 32),
                f"layers.{i}.mlp.up_proj.weight": (48, 32),
                f"layers.{i}.mlp.down_proj.weight": (32, 48),
            }
        )
    assert names == expected


def test_from_target_qwen36_widths_and_parameter_count():
    cfg = DrafterConfig.from_target(QWEN36_TEXT, ModelConfig(), layer_ids=[1, 16, 31, 46], mask_token_id=248319)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (5120, 17408, 5)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (24, 4, 256, 248320)
    # The target's theta, but never its partial rotary factor (0.25): the drafter rotates its whole head.
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rope_scaling, cfg.num_target_layers) == (1e7, 1.0, None, 64)
    assert cfg.feature_width == 4 * 5120 and cfg.block_size == 16
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    per_layer = 5120 * 24 * 256 * 2 + 5120 * 4 * 256 * 2 + 3 * 5120 * 17408 + 2 * 5120 + 2 * 256
    assert model.num_parameters() == 4 * 5120 * 5120 + 5120 + 5 * per_layer + 5120
    model = ModelConfig(num_layers=2, intermediate_size=1024, head_dim=128)
    small = DrafterConfig.from_target(QWEN36_TEXT, model, layer_ids=[1, 16], mask_token_id=0)
    assert (small.intermediate_size, small.head_dim, small.num_hidden_layers) == (1024, 128, 2)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("target_layer_ids", [1, 1], "duplicates"),
        ("target_layer_ids", [0, 9], "outside"),
        ("mask_token_id", 40, "mask_token_id"),
        ("num_key_value_heads", 3, "num_attention_heads"),
        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope_scaling"),
    ],
)
def test_config_errors_name_the_field(field, value, needle):
    with pytest.raises(ValueError, match=needle):
        tiny_config(**{field: value})


def test_target_head_embeds_and_projects():
    embed, head = torch.randn(40, 32), torch.randn(40, 32)
    th = TargetHead(embed, head)
    ids = torch.tensor([[1, 39]])
    assert torch.equal(th.embed(ids), embed[ids])
    torch.testing.assert_close(th.logits(torch.ones(1, 32)), head.sum(1)[None])
    assert not any(True for _ in th.parameters())  # frozen: buffers only, no optimizer sees them
    assert th.state_dict() == {}  # and no checkpoint stores them


def test_compiled_paths_trace_as_one_graph():
    """The GPU path compiles the drafter and the loss chunk: both must trace without graph breaks
    (fullgraph) and match eager, forward and backward. aot_eager checks tracing without a C compiler."""
    import warnings

    from train.attention import build_layer_masks
    from train.loss import chunk_loss_and_grad

    torch.manual_seed(4)
    # The training step's real inputs: {layer type: mask} for a mixed layout (one sliding, one full layer).
    cfg = tiny_config(num_hidden_layers=2, partial_rotary_factor=0.5, layer_types="sliding_then_full", sliding_window=3)
    model = DFlashDrafter(cfg)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    B, S, K = 2, 10, 4
    anchors, keep = torch.tensor([[2, 5, 7], [1, 3, 0]]), torch.tensor([[True, True, True], [True, True, False]])
    positions = torch.cat([torch.arange(S).expand(B, S), (anchors[:, :, None] + torch.arange(K)).view(B, -1)], 1)
    noise, hidden = torch.randn(B, 3 * K, 32), torch.randn(B, S, 64)
    masks = build_layer_masks("sdpa", anchors, keep, S, K, cfg.mask_rules)
    out, ref = compiled(noise, hidden, positions, masks), model(noise, hidden, positions, masks)
    torch.testing.assert_close(out, ref)
    (g_out,) = torch.autograd.grad(out.square().sum(), model.fc.weight)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), model.fc.weight)
    torch.testing.assert_close(g_out, g_ref)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        block_masks = build_layer_masks("flex", anchors, keep, S, K, cfg.mask_rules)
        torch.testing.assert_close(
            compiled(noise, hidden, positions, block_masks), model(noise, hidden, positions, block_masks)
        )
    chunk = torch.compile(chunk_loss_and_grad, backend="aot_eager", dynamic=True, fullgraph=True)
    for rows in (5, 7):
        args = (
            torch.randn(rows, 40),
            torch.randint(0, 40, (rows,)),
            torch.rand(rows),
            torch.randint(0, 40, (rows, 3)),
            torch.log_softmax(torch.randn(rows, 3), -1),
            0.5,
            2.0,
        )
        for a, b in zip(chunk(*args), chunk_loss_and_grad(*args), strict=True):
            torch.testing.assert_close(a, b)
