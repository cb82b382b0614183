"""Writes a Megatron-Core `torch_dist` checkpoint from a transformers model (test helper, not a test).

Written from Megatron's layout rules, apart from lathe's reader (`lathe.models.megatron_ckpt`): a GPTModel's sharded
keys (`embedding.word_embeddings.weight`, `decoder.layers...`, `decoder.final_layernorm.weight`, `output_layer.weight`),
q/k/v fused per key/value group ([q heads of group g; k_g; v_g], verl's scripts/converter_hf_to_mcore.py), SwiGLU's
`linear_fc1` = [gate; up], the norms fused into the next linear layer (TE's `layer_norm_weight`), MoE layers with
`pre_mlp_layernorm`, `mlp.router` and experts. One process saves the global tensors with
`torch.distributed.checkpoint.save(no_dist=True)`, as Megatron's torch_dist strategy leaves them (global shapes,
whatever the parallel layout), beside `metadata.json`.

Layouts: `stacked` layers (`decoder.layers.<name>` with the layer axis prepended: Megatron's homogeneous layout) or
numbered (`decoder.layers.<i>.<name>`); experts `stacked` (`mlp.experts.linear_fc1.weight`, expert axis prepended),
`numbered` (`mlp.experts.<e>.linear_fc1.weight`, each `linear_fc1` split into `_w`/`_v` as
`singleton_local_shards` saves it) or `te` (TE's `mlp.experts.linear_fc1.weight<e>`).
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import torch


def _qkv(sd: dict, p: str, heads: int, groups: int, kind: str) -> torch.Tensor:
    q, k, v = (sd[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv")
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k = k.reshape(groups, -1, *rest)
    v = v.reshape(groups, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _experts(sd: dict, p: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fc1 (E, 2F, H) = [gate; up] per expert, fc2 (E, H, F)) from the transformers 5 fused tensors."""
    if f"{p}mlp.experts.gate_up_proj" not in sd:
        return None
    return sd[f"{p}mlp.experts.gate_up_proj"], sd[f"{p}mlp.experts.down_proj"]


def layer_tensors(sd: dict, i: int, hf) -> dict[str, torch.Tensor]:
    """One decoder layer under Megatron's names (experts stacked on a leading axis)."""
    p = f"model.layers.{i}."
    out = {}
    mla = getattr(hf, "kv_lora_rank", None) is not None
    if mla:
        out["input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        a = "self_attention."
        if getattr(hf, "q_lora_rank", None) is None:
            out[a + "linear_q_proj.weight"] = sd[p + "self_attn.q_proj.weight"]
        else:
            out[a + "linear_q_down_proj.weight"] = sd[p + "self_attn.q_a_proj.weight"]
            out[a + "linear_q_up_proj.weight"] = sd[p + "self_attn.q_b_proj.weight"]
            out[a + "linear_q_up_proj.layer_norm_weight"] = sd[p + "self_attn.q_a_layernorm.weight"]
        out[a + "linear_kv_down_proj.weight"] = sd[p + "self_attn.kv_a_proj_with_mqa.weight"]
        out[a + "linear_kv_up_proj.weight"] = sd[p + "self_attn.kv_b_proj.weight"]
        out[a + "linear_kv_up_proj.layer_norm_weight"] = sd[p + "self_attn.kv_a_layernorm.weight"]
    else:
        out["self_attention.linear_qkv.layer_norm_weight"] = sd[p + "input_layernorm.weight"]
        for kind in ("weight", "bias"):
            if f"{p}self_attn.q_proj.{kind}" in sd:
                out[f"self_attention.linear_qkv.{kind}"] = _qkv(sd, p, hf.num_attention_heads,
                                                               hf.num_key_value_heads, kind)
        if p + "self_attn.q_norm.weight" in sd:
            out["self_attention.q_layernorm.weight"] = sd[p + "self_attn.q_norm.weight"]
            out["self_attention.k_layernorm.weight"] = sd[p + "self_attn.k_norm.weight"]
    out["self_attention.linear_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
    experts = _experts(sd, p)
    if experts is None:            # dense: the post-attention norm fused into linear_fc1
        out["mlp.linear_fc1.layer_norm_weight"] = sd[p + "post_attention_layernorm.weight"]
        out["mlp.linear_fc1.weight"] = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        out["mlp.linear_fc2.weight"] = sd[p + "mlp.down_proj.weight"]
        return out
    out["pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
    out["mlp.router.weight"] = sd[p + "mlp.gate.weight"]
    if p + "mlp.gate.e_score_correction_bias" in sd:
        out["mlp.router.expert_bias"] = sd[p + "mlp.gate.e_score_correction_bias"]
    out["mlp.experts.linear_fc1.weight"], out["mlp.experts.linear_fc2.weight"] = experts
    if p + "mlp.shared_experts.gate_proj.weight" in sd:
        s = p + "mlp.shared_experts."
        out["mlp.shared_experts.linear_fc1.weight"] = torch.cat([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]])
        out["mlp.shared_experts.linear_fc2.weight"] = sd[s + "down_proj.weight"]
    return out


def _number_experts(layer: dict, style: str) -> dict:
    out = {}
    for name, t in layer.items():
        if not name.startswith("mlp.experts.") or style == "stacked":
            out[name] = t
            continue
        proj = name[len("mlp.experts."):].rpartition(".")[0]           # linear_fc1 / linear_fc2
        for e in range(t.shape[0]):
            if style == "te":
                out[f"mlp.experts.{proj}.weight{e}"] = t[e]
            elif proj == "linear_fc1":                                  # singleton_local_shards: gate, up apart
                gate, up = t[e].chunk(2)
                out[f"mlp.experts.{e}.{proj}.weight_w"], out[f"mlp.experts.{e}.{proj}.weight_v"] = gate, up
            else:
                out[f"mlp.experts.{e}.{proj}.weight"] = t[e]
    return out


def megatron_state(model, *, stacked: bool = False, experts: str = "stacked", pad_vocab_to: int | None = None,
                   extra: dict | None = None) -> dict:
    """The sharded-key state dict Megatron's GPTModel would save for `model` (a transformers causal LM)."""
    hf = model.config
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {}
    emb = sd["model.embed_tokens.weight"]
    pad = 0 if pad_vocab_to is None else pad_vocab_to - emb.shape[0]
    out["embedding.word_embeddings.weight"] = torch.cat([emb, torch.zeros(pad, emb.shape[1])])
    if not hf.tie_word_embeddings:
        out["output_layer.weight"] = torch.cat([sd["lm_head.weight"], torch.zeros(pad, emb.shape[1])])
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    layers = [_number_experts(layer_tensors(sd, i, hf), experts) for i in range(hf.num_hidden_layers)]
    if stacked:       # a tensor some layers lack (dense vs MoE): one `<key>@<i>` per layer, merged by `save_megatron`
        for n in sorted({n for layer in layers for n in layer}):
            have = [i for i, layer in enumerate(layers) if n in layer]
            if len(have) == len(layers):
                out[f"decoder.layers.{n}"] = torch.stack([layer[n] for layer in layers])
            else:
                out.update({f"decoder.layers.{n}@{i}": layers[i][n][None] for i in have})
    else:
        out.update({f"decoder.layers.{i}.{n}": t for i, layer in enumerate(layers) for n, t in layer.items()})
    out.update(extra or {})
    return out


def save_megatron(model, path: Path, prefix: str = "", **layout) -> Path:
    """`megatron_state(model, **layout)` saved as a torch_dist checkpoint in `path`, with a TE `_extra_state` (bytes),
    an MTP tensor and an optimizer entry beside the weights, as real checkpoints have; `prefix` before each model key
    (`GPTModel.sharded_state_dict(prefix=...)`, NeMo 2's 'module.')."""
    import torch.distributed.checkpoint as dcp
    state = {prefix + k: v for k, v in megatron_state(model, **layout).items()}
    state["decoder.layers.0.self_attention.core_attention._extra_state/shard_0_1"] = io.BytesIO(b"te state")
    state["mtp.layers.0.enorm.weight"] = torch.ones(model.config.hidden_size)
    state["optimizer.state.exp_avg.decoder.final_layernorm.weight"] = torch.zeros(model.config.hidden_size)
    path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    _merge_layer_chunks(path, model.config.num_hidden_layers)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    return path


def _merge_layer_chunks(path: Path, num_layers: int) -> None:
    """Rewrite the DCP index so that each `<key>@<i>` entry (one layer, a leading axis of 1) becomes layer i's chunk of
    `<key>` (global leading axis `num_layers`): what Megatron's homogeneous layout saves for a tensor only some layers
    have (a stacked tensor whose chunks cover those layers only; mcore before 0.11 for mixed dense/MoE models)."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
    md = dcp.FileSystemReader(str(path)).read_metadata()
    parts = sorted(k for k in md.state_dict_metadata if "@" in k)
    if not parts:
        return
    for part in parts:
        key, i = part.split("@")[0], int(part.split("@")[1])
        one = md.state_dict_metadata.pop(part)
        size = torch.Size([num_layers, *one.size[1:]])
        chunk = ChunkStorageMetadata(offsets=torch.Size([i] + [0] * (len(size) - 1)), sizes=one.size)
        merged = md.state_dict_metadata.setdefault(key, TensorStorageMetadata(one.properties, size, []))
        merged.chunks.append(chunk)
        (index, info), = [(m, s) for m, s in md.storage_data.items() if m.fqn == part]
        del md.storage_data[index]
        md.storage_data[MetadataIndex(key, chunk.offsets)] = info
        if md.planner_data is not None:
            md.planner_data.pop(part, None)
            md.planner_data[key] = (key,)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)
