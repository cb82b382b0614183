"""A tiny random MiMo checkpoint (`MiMoForCausalLM`: a Qwen2 body plus MTP layers), built from a transformers Qwen2
model and random MTP tensors under MiMo's names (test helper, not a test). transformers has no MiMo class (the real
checkpoints load with trust_remote_code), so the main model is compared with its Qwen2."""

from __future__ import annotations

import json
from pathlib import Path

import torch

MTP_PARTS = {  # name under model.mtp_layers.<k>. -> shape, as functions of (hidden H, intermediate I, heads, kv, D)
    "token_layernorm.weight": lambda H, I, q, kv, D: (H,),
    "hidden_layernorm.weight": lambda H, I, q, kv, D: (H,),
    "input_proj.weight": lambda H, I, q, kv, D: (H, 2 * H),
    "final_layernorm.weight": lambda H, I, q, kv, D: (H,),
    "input_layernorm.weight": lambda H, I, q, kv, D: (H,),
    "post_attention_layernorm.weight": lambda H, I, q, kv, D: (H,),
    "self_attn.q_proj.weight": lambda H, I, q, kv, D: (q * D, H),
    "self_attn.q_proj.bias": lambda H, I, q, kv, D: (q * D,),
    "self_attn.k_proj.weight": lambda H, I, q, kv, D: (kv * D, H),
    "self_attn.k_proj.bias": lambda H, I, q, kv, D: (kv * D,),
    "self_attn.v_proj.weight": lambda H, I, q, kv, D: (kv * D, H),
    "self_attn.v_proj.bias": lambda H, I, q, kv, D: (kv * D,),
    "self_attn.o_proj.weight": lambda H, I, q, kv, D: (H, q * D),
    "mlp.gate_proj.weight": lambda H, I, q, kv, D: (I, H),
    "mlp.up_proj.weight": lambda H, I, q, kv, D: (I, H),
    "mlp.down_proj.weight": lambda H, I, q, kv, D: (H, I),
}


def mtp_tensors(config: dict, layers: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random MTP tensors for `layers` MiMo MTP layers (norms around 1, the rest ~ N(0, 0.1))."""
    gen = torch.Generator().manual_seed(seed)
    H, I = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"], config["num_key_value_heads"]
    D = H // q
    out = {}
    for k in range(layers):
        for part, shape in MTP_PARTS.items():
            t = torch.randn(shape(H, I, q, kv, D), generator=gen) * 0.1
            out[f"model.mtp_layers.{k}.{part}"] = t + 1.0 if "norm" in part else t
    return out


def save_mimo(path: Path, *, layers: int = 1, vocab_size: int = 101, seed: int = 0, with_mtp: bool = True,
              tokenizer=None):
    """(directory, the transformers Qwen2 model of its main body): a MiMo checkpoint with `layers` MTP layers (their
    tensors left out with `with_mtp=False`, the config still declaring them)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    extra = {} if tokenizer is None else dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.1, rope_theta=10000.0, tie_word_embeddings=False, **extra)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    d = json.loads((path / "config.json").read_text())
    d.update(architectures=["MiMoForCausalLM"], model_type="mimo", num_nextn_predict_layers=layers)
    (path / "config.json").write_text(json.dumps(d, indent=2))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if with_mtp:
        state.update(mtp_tensors(d, layers, seed + 1))
    for f in path.glob("model*.safetensors"):
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path, model
