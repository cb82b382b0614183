"""Speed of light of a GRPO step: the least time the hardware needs for each phase, from the model's shape alone.

Each phase's bound is its FLOPs over the device's matmul rate, its bytes over the HBM bandwidth, or (decode) the larger
of the two per step. Assumptions, all of which make the bound lower, never higher, than what the work needs:
- bf16 weights and KV cache (2 bytes); every matmul at the measured dense bf16 rate, attention included;
- FLOPs count the linear layers (q/k/v/o, gate/up/down, lm_head) and causal attention (QK^T and PV); norms, rotary
  embedding, biases, softmax and the sampler count nothing; the embedding is a lookup (one row per token);
- the lm_head runs only where logits are needed: the last prompt token in the prefill, the response tokens in the
  log-prob passes and the update;
- each distinct prompt is prefilled once (its `n` samples share it); where the run's engine reads a shared prompt's
  K/V once per group of rows (`shared_rows`) and where its training passes compute each prompt once
  (`grouped`: `actor.use_prefix_grouper`), the bounds count that work too;
- the optimizer step, host work, the reward and the weight sync into the engine are left out (the sync's work
  depends on what the colocated engine shares with the trainer: at 7B lathe's took less than a read + write of
  every bf16 weight, so that is no bound).

Shapes are `bench/common.py`'s SHAPES dicts (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, vocab_size, tie_word_embeddings; head_dim = hidden / heads unless given). A mixture-of-experts
shape adds `num_experts` (E), `num_experts_per_tok` (k) and `moe_intermediate_size` (each expert's width; GPT-OSS's
experts are `intermediate_size` wide and carry biases): its FLOPs count the k active experts and the router per token,
its parameter count all E, and a decode step reads, as issue 44 defines its roofline, the *active* parameters (the
non-expert weights and k experts a layer) — a floor: a batch of many rows touches most experts each step. A shape with
`sliding_window` and `layer_types` (GPT-OSS) attends, in its sliding layers, to at most that many keys a query, and its
decode reads at most that many tokens' K and V there.

The *touched* decode bound (`touched_weight_bytes`) is what a MoE step physically reads: the non-expert weights and,
in each layer, the experts that some row of the step is routed to — for B rows each choosing k of E experts at
random, E(1 - (1 - k/E)^B) of them on average (k at B = 1, nearly E at 256 rows x top-8 of 128). Random weights
route near uniformly; a trained router is skewed, touches fewer, and lies between the two bounds. The active bound
over the touched one is the most of the active roofline a step at that batch can reach. A dense shape's two are one.

A hybrid shape (Qwen3.5: `linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`,
`linear_value_head_dim`, `linear_conv_kernel_dim` and `layer_types` with `linear_attention` entries) has, in its
linear-attention (gated DeltaNet) layers, projections to q|k|v (through a depthwise convolution), z, b and a and an
output projection, and no KV cache: a decode step reads and writes back each sequence's recurrent state (value heads
x key dim x value dim, float32 as lathe's engine keeps it) and convolution inputs (q|k|v width x (kernel - 1)). Its
full-attention layers' q_proj is twice as wide (a query and an output gate per head); a MoE hybrid adds a shared
expert (`shared_expert_intermediate_size`) and its one-column gate. Only the attention layers hold KV.

A Nemotron-H shape (`layers_block_type`: each layer one block, `linear_attention` (Mamba2), `full_attention`, `mlp`
or `moe`; `mamba_num_heads` H, `mamba_head_dim` P, `n_groups` G, `ssm_state_size` N, `conv_kernel`; its MoE's
`n_routed_experts`, `moe_intermediate_size`, `moe_shared_expert_intermediate_size`, `moe_latent_size`) counts each
block's own matrices: a Mamba2 block's in_proj to z, x, B, C and dt (h (2 H P + 2 G N + H)) and out_proj; the
attention's q/k/v/o (no RoPE); the relu^2 MLP's up and down; the MoE's router, k (all E for parameters) non-gated
experts of 2 x width x i on the latent width (h without latent projections), the latent projections and the shared
expert. A decode step reads and writes back each sequence's Mamba2 state (H x P x N, float32) and convolution inputs.
Self-contained, so a test can load it by path.
"""

from __future__ import annotations

import math

# (name contains, matmul FLOP/s, HBM bytes/s), first match wins; a device not listed (CPU too) gets no figure.
# matmul: a bf16 8192^3 torch.matmul measured at about 790 TFLOP/s on H100 80GB HBM3 and on H200
# (../shared/device/README.md, 2026-11-20). HBM: datasheet, 3.35 TB/s H100 SXM, 4.8 TB/s H200.
DEVICE_RATES = [("H100 PCIe", None, None),   # not measured: no figure rather than a guess
                ("H100", 790e12, 3.35e12),
                ("H200", 790e12, 4.8e12)]
RATES_SOURCE = ("matmul 790 TFLOP/s: bf16 8192^3 torch.matmul measured on H100 and H200 (shared/device/README.md); "
                "HBM: datasheet (H100 3.35 TB/s, H200 4.8 TB/s)")
BYTES = 2   # bf16
PHASES = ("gen", "old_log_prob", "ref", "teacher", "update_actor")   # timing_s/* names with a bound


def device_rates(name: str) -> tuple[float | None, float | None]:
    """(matmul FLOP/s, HBM bytes/s) of the device called `name`, or (None, None)."""
    return next(((f, b) for key, f, b in DEVICE_RATES if key in name), (None, None))


def _dims(shape: dict) -> tuple[int, int, int, int, int, int, int]:
    """(hidden, intermediate (0 where every layer is MoE and none is given), layers, q width, kv width, vocab,
    head_dim)."""
    h, heads = shape["hidden_size"], shape["num_attention_heads"]
    hd = shape.get("head_dim") or h // heads
    return (h, shape.get("intermediate_size", 0), shape["num_hidden_layers"], heads * hd,
            shape["num_key_value_heads"] * hd, shape["vocab_size"], hd)


def _kinds(shape: dict) -> list[str]:
    """Each layer's token mixer: full_attention, sliding_attention or linear_attention (a Nemotron-H shape's
    blocks: also mlp and moe)."""
    return (shape.get("layers_block_type") or shape.get("layer_types")
            or ["full_attention"] * shape["num_hidden_layers"])


def _nemotron(shape: dict) -> bool:
    return "layers_block_type" in shape


def _mamba_dims(shape: dict) -> tuple[int, int, int]:
    """A Nemotron-H Mamba2 block's (inner width H P, B and C width G N each, heads H)."""
    heads = shape["mamba_num_heads"]
    return heads * shape["mamba_head_dim"], shape["n_groups"] * shape["ssm_state_size"], heads


def _block_params(shape: dict, kind: str, experts: int) -> int:
    """A Nemotron-H block's matrices (module doc), its MoE with `experts` experts."""
    h, i, _, q, kv, _, _ = _dims(shape)
    if kind == "linear_attention":
        inner, bc, heads = _mamba_dims(shape)
        return h * (2 * inner + 2 * bc + heads) + inner * h
    if kind == "full_attention":
        return 2 * h * q + 2 * h * kv
    if kind == "mlp":
        return 2 * h * i
    latent = shape.get("moe_latent_size") or 0
    return (h * _num_experts(shape) + experts * 2 * (latent or h) * shape["moe_intermediate_size"]
            + 2 * h * latent + 2 * h * shape["moe_shared_expert_intermediate_size"])


def _block_vectors(shape: dict, kind: str) -> int:
    """A Nemotron-H block's norm; a Mamba2 block's convolution (weight and bias), dt_bias, A_log, D and gated norm."""
    h = shape["hidden_size"]
    if kind != "linear_attention":
        return h
    inner, bc, heads = _mamba_dims(shape)
    return h + (inner + 2 * bc) * (shape.get("conv_kernel", 4) + 1) + 3 * heads + inner


def _num_experts(shape: dict) -> int:
    return shape.get("num_experts") or shape.get("n_routed_experts") or 0


def _expert_matrix(shape: dict) -> int:
    """One routed expert's weights: 3 x h x i (SwiGLU), Nemotron-H's 2 x width x i (non-gated, on the latent width)."""
    if _nemotron(shape):
        return 2 * (shape.get("moe_latent_size") or shape["hidden_size"]) * shape["moe_intermediate_size"]
    return 3 * shape["hidden_size"] * _expert_width(shape)


def _moe_layers(shape: dict) -> int:
    return _kinds(shape).count("moe") if _nemotron(shape) else shape["num_hidden_layers"]


def _linear_dims(shape: dict) -> tuple[int, int, int, int]:
    """A hybrid's linear-attention (conv width = q|k|v, value width, value heads, key head dim)."""
    key = shape["linear_num_key_heads"] * shape["linear_key_head_dim"]
    value = shape["linear_num_value_heads"] * shape["linear_value_head_dim"]
    return 2 * key + value, value, shape["linear_num_value_heads"], shape["linear_key_head_dim"]


def _mixer_params(shape: dict, kind: str) -> int:
    """The matrices of one layer's token mixer: attention h*q (twice that in a hybrid: the output gate) + 2*h*kv +
    q*h; linear attention h*(conv width + value width + 2 x value heads) + value width*h."""
    h, _, _, q, kv, _, _ = _dims(shape)
    if kind == "linear_attention":
        conv, value, v_heads, _ = _linear_dims(shape)
        return h * (conv + value + 2 * v_heads) + value * h
    return (2 if "linear_num_value_heads" in shape else 1) * h * q + 2 * h * kv + q * h


def _small_params(shape: dict, kind: str) -> int:
    """One layer's vectors: two norms; an attention layer's q/k/v biases (Qwen2) or q/k norms (Qwen3-MoE, hybrids);
    a linear layer's convolution (conv width x kernel), dt_bias, A_log and gated norm."""
    h, _, _, q, kv, _, hd = _dims(shape)
    if kind == "linear_attention":
        conv, _, v_heads, _ = _linear_dims(shape)
        return conv * shape.get("linear_conv_kernel_dim", 4) + 2 * v_heads + shape["linear_value_head_dim"] + 2 * h
    qk_norms = shape.get("num_experts") or "linear_num_value_heads" in shape
    return (2 * hd if qk_norms else q + 2 * kv) + 2 * h


def linear_state_bytes(shape: dict) -> int:
    """Bytes of one sequence's linear-attention states that a decode step reads and writes back: per linear layer
    the recurrent state (value heads x key dim x value dim, float32; Mamba2's H x P x N) and the convolution inputs
    (conv width x (kernel - 1), bf16). 0 without linear layers."""
    layers = _kinds(shape).count("linear_attention")
    if not layers:
        return 0
    if _nemotron(shape):
        inner, bc, _ = _mamba_dims(shape)
        return layers * (inner * shape["ssm_state_size"] * 4 + (inner + 2 * bc) * (shape.get("conv_kernel", 4) - 1)
                         * BYTES)
    conv, value, _, key_dim = _linear_dims(shape)
    return 2 * layers * (value * key_dim * 4 + conv * (shape.get("linear_conv_kernel_dim", 4) - 1) * BYTES)


def _linear_state_flops(shape: dict) -> int:
    """The gated delta rule's work per token, all linear layers: about four passes over each value head's Dk x Dv
    state (decay, S^T k, the rank-one update, S^T q) of 2 FLOPs an element (the chunked form does about as much)."""
    layers = _kinds(shape).count("linear_attention")
    if not layers:
        return 0
    if _nemotron(shape):                 # Mamba2: the same four passes over each head's P x N state
        return layers * 8 * _mamba_dims(shape)[0] * shape["ssm_state_size"]
    _, value, _, key_dim = _linear_dims(shape)
    return layers * 8 * value * key_dim


def _expert_width(shape: dict) -> int:
    return shape.get("moe_intermediate_size") or shape["intermediate_size"]


def _mlp_params(shape: dict, experts: int) -> int:
    """One layer's MLP matrices with `experts` experts (a MoE shape; their router, and a hybrid's shared expert and
    its gate, too), else the dense SwiGLU."""
    h = shape["hidden_size"]
    if not shape.get("num_experts"):
        return 3 * h * shape["intermediate_size"]
    shared = shape.get("shared_expert_intermediate_size") or 0
    return experts * 3 * h * _expert_width(shape) + h * shape["num_experts"] + (3 * h * shared + h if shared else 0)


def layer_matmul_params(shape: dict) -> int:
    """Weights of the decoder layers' matrices one token runs through: per layer its token mixer's (`_mixer_params`)
    + its MLP: 3*h*i dense, or k experts' 3*h*i_e plus the router's h*E (and a shared expert)."""
    if _nemotron(shape):
        return sum(_block_params(shape, kind, shape["num_experts_per_tok"]) for kind in _kinds(shape))
    mlp = _mlp_params(shape, shape.get("num_experts_per_tok", 0))
    return sum(_mixer_params(shape, kind) + mlp for kind in _kinds(shape))


def param_count(shape: dict) -> int:
    """All parameters: layer matrices (every expert), q/k/v biases (Qwen2; a MoE or hybrid shape's attention: none
    but its per-head q/k norms), a linear layer's convolution and vectors, two norms per layer, the final norm, the
    embedding, and the lm_head unless tied (GPT-OSS's attention biases, sinks and expert biases are left out: under
    0.1%)."""
    h, _, _, _, _, v, _ = _dims(shape)
    if _nemotron(shape):
        layers = sum(_block_params(shape, kind, _num_experts(shape)) + _block_vectors(shape, kind)
                     for kind in _kinds(shape))
    else:
        mlp = _mlp_params(shape, shape.get("num_experts", 0))
        layers = sum(_mixer_params(shape, kind) + mlp + _small_params(shape, kind) for kind in _kinds(shape))
    return layers + h + v * h * (1 if shape["tie_word_embeddings"] else 2)


def decode_weight_bytes(shape: dict) -> int:
    """Weight bytes one decode step reads: every parameter but the embedding table (looked up one row per token)
    and, in a MoE shape, the experts no token of the step is routed to — counted as only k a layer (the active
    parameters: a floor); the lm_head is read whole, tied or not."""
    h, v = shape["hidden_size"], shape["vocab_size"]
    untied_embedding = 0 if shape["tie_word_embeddings"] else v * h
    idle = 0
    if _num_experts(shape):
        idle = _moe_layers(shape) * (_num_experts(shape) - shape["num_experts_per_tok"]) * _expert_matrix(shape)
    return BYTES * (param_count(shape) - untied_embedding - idle)


def expected_distinct_experts(experts: int, top_k: int, rows: int) -> float:
    """The experts that `rows` rows, each routed to `top_k` of `experts` at random, touch on average:
    E (1 - (1 - k/E)^B) (one row misses a given expert with probability 1 - k/E)."""
    return experts * (1 - (1 - top_k / experts) ** rows)


def touched_weight_bytes(shape: dict, rows: int) -> float:
    """The weight bytes a decode step of `rows` (>= 1) rows physically reads: `decode_weight_bytes` plus, in each MoE
    layer, the experts beyond k that the rows are expected to touch (`expected_distinct_experts`). A dense shape:
    `decode_weight_bytes`."""
    if not _num_experts(shape):
        return decode_weight_bytes(shape)
    experts, k = _num_experts(shape), shape["num_experts_per_tok"]
    extra = expected_distinct_experts(experts, k, rows) - k
    return decode_weight_bytes(shape) + BYTES * _moe_layers(shape) * extra * _expert_matrix(shape)


def _windows(shape: dict) -> list[int | None]:
    """Each attention layer's window (None: the whole causal context); linear-attention layers have none."""
    return [shape.get("sliding_window") if k == "sliding_attention" else None
            for k in _kinds(shape) if k in ("full_attention", "sliding_attention")]


def kv_bytes_per_token(shape: dict) -> int:
    """K and V of one token in all attention layers (not the linear ones): 2 x layers x kv heads x head_dim x 2
    bytes."""
    _, _, _, _, kv, _, _ = _dims(shape)
    return 2 * len(_windows(shape)) * kv * BYTES


def _kv_bytes_read(shape: dict, context: int) -> int:
    """K and V bytes one decode step reads for one sequence of `context` tokens (a sliding layer: its window)."""
    _, _, _, _, kv, _, _ = _dims(shape)
    return sum(2 * kv * BYTES * (context if w is None else min(context, w)) for w in _windows(shape))


def attention_flops(shape: dict, length: int) -> int:
    """Causal self-attention of one sequence of `length` tokens: QK^T and PV over the lower triangle,
    2 x 2 x attention layers x q width x length(length+1)/2 (a sliding layer: each query over at most its window of
    keys); a hybrid's linear layers: their state work (`_linear_state_flops`) per token."""
    _, _, _, q, _, _, _ = _dims(shape)
    total = _linear_state_flops(shape) * length
    for w in _windows(shape):
        pairs = length * (length + 1) // 2
        if w is not None and length > w:          # queries past the window see w keys each
            pairs = w * (w + 1) // 2 + (length - w) * w
        total += 4 * q * pairs
    return total


def forward_flops(shape: dict, lengths: list[int], logit_rows: int) -> int:
    """One forward over sequences of `lengths`: 2 x layer matrix params per token, the lm_head (2 x V x h) on
    `logit_rows` rows, plus causal attention."""
    h, v = shape["hidden_size"], shape["vocab_size"]
    return (2 * layer_matmul_params(shape) * sum(lengths) + 2 * v * h * logit_rows
            + sum(attention_flops(shape, s) for s in lengths))


def grouped_forward_flops(shape: dict, prompts: int, n: int, prompt_len: int, response_len: int,
                          logit_rows: int) -> int:
    """One prefix-grouped forward (`actor.use_prefix_grouper`) over `prompts` groups: each prompt's tokens once, its
    `n` responses each attending to the whole prompt and causally to themselves (a sliding layer: each query over at
    most its window of keys); the lm_head on `logit_rows` rows. Linear-attention layers: their state work on each
    token computed (a prompt's once; the copies of its last K-1 inputs in front of each response are left out)."""
    h, v = shape["hidden_size"], shape["vocab_size"]
    _, _, _, q, _, _, _ = _dims(shape)
    P, R = prompt_len, response_len
    pairs = sum(_keys_seen(0, P, w) + n * _keys_seen(P, P + R, w) for w in _windows(shape))
    tokens = prompts * (P + n * R)
    return ((2 * layer_matmul_params(shape) + _linear_state_flops(shape)) * tokens + 2 * v * h * logit_rows
            + prompts * 4 * q * pairs)


def _keys_seen(first: int, last: int, window: int | None) -> int:
    """The keys the queries at positions first .. last - 1 of a sequence see, causally (within `window`)."""
    cut = last if window is None else max(first, min(last, window))     # below it a query sees all before it
    return (cut * (cut + 1) - first * (first + 1)) // 2 + (last - cut) * (window or 0)


def prefill_seconds(shape: dict, prompts: int, prompt_len: int, flops_per_s: float) -> float:
    """Each distinct prompt once, logits on its last token: forward FLOPs over the matmul rate."""
    return forward_flops(shape, [prompt_len] * prompts, prompts) / flops_per_s


def decode_seconds(shape: dict, seqs: int, prompt_len: int, response_len: int, bytes_per_s: float,
                   flops_per_s: float | None = None, max_num_seqs: int | None = None, touched: bool = False,
                   shared_rows: int = 1) -> float:
    """The decode steps after the prefill (which gives each sequence its first token): `response_len - 1` steps,
    step k (1..R-1) with context P + k per sequence. A step takes the longer of
      bytes: decode_weight_bytes (`touched`: touched_weight_bytes at the step's batch) + running sequences x
        (context x kv_bytes_per_token + linear_state_bytes), over the bandwidth, and
      FLOPs: running sequences x (2 x (layer matrix params + V x h) + 4 x attention layers x q width x context
        + the linear layers' state work), over the rate.
    All sequences decode together (fixed lengths, ignore_eos); with `max_num_seqs` below `seqs` they run in
    waves of at most `max_num_seqs`, one after another. `shared_rows` > 1 (lathe's shared-prefix decode attention,
    where it runs: the engine's `rollout.shared_prefix_attention`): the prompt's K/V are read once for every group of
    that many rows (the `n` samples of a prompt sit together), the rest of each context by its own row."""
    h, _, _, q, _, v, _ = _dims(shape)
    cap = max_num_seqs or seqs
    waves = [min(cap, seqs - start) for start in range(0, seqs, cap)]
    lin = 2 * (layer_matmul_params(shape) + v * h) + _linear_state_flops(shape)
    windows, state = _windows(shape), linear_state_bytes(shape)
    total = 0.0
    for batch in waves:
        wbytes = touched_weight_bytes(shape, batch) if touched else decode_weight_bytes(shape)
        saved = (batch - math.ceil(batch / shared_rows)) * _kv_bytes_read(shape, prompt_len)
        for k in range(1, response_len):
            ctx = prompt_len + k
            seconds = (wbytes + batch * (_kv_bytes_read(shape, ctx) + state) - saved) / bytes_per_s
            if flops_per_s:
                keys = sum(ctx if w is None else min(ctx, w) for w in windows)
                seconds = max(seconds, batch * (lin + 4 * q * keys) / flops_per_s)
            total += seconds
    return total


def log_prob_seconds(shape: dict, seqs: int, prompt_len: int, response_len: int, flops_per_s: float,
                     n: int | None = None) -> float:
    """A log-prob pass (old or reference): one forward over the whole sequences, logits on the response tokens;
    with `n`, prefix-grouped (`grouped_forward_flops`: each prompt once for its n sequences)."""
    return _pass_flops(shape, seqs, prompt_len, response_len, seqs * response_len, n) / flops_per_s


def _pass_flops(shape: dict, seqs: int, prompt_len: int, response_len: int, logit_rows: int, n: int | None) -> int:
    if n is None:
        return forward_flops(shape, [prompt_len + response_len] * seqs, logit_rows)
    return grouped_forward_flops(shape, seqs // n, n, prompt_len, response_len, logit_rows)


def update_seconds(shape: dict, seqs: int, prompt_len: int, response_len: int, flops_per_s: float,
                   checkpointing: bool | float = False, n: int | None = None) -> float:
    """Forward + backward = 3 x the log-prob pass's forward FLOPs, plus with gradient checkpointing the decoder
    layers' forward once more (lm_head not recomputed); a float `checkpointing` is the fraction of the layers that
    recompute (`gradient_checkpointing_layers` of all); `n`: prefix-grouped, as `log_prob_seconds`."""
    flops = 3 * _pass_flops(shape, seqs, prompt_len, response_len, seqs * response_len, n)
    if checkpointing:
        flops += float(checkpointing) * _pass_flops(shape, seqs, prompt_len, response_len, 0, n)
    return flops / flops_per_s


def step_light(shape: dict, device: str, *, prompts: int, n: int, prompt_len: int, response_len: int,
               measured: dict, step_s: float | None, checkpointing: bool, gpus: int = 1,
               max_num_seqs: int | None = None, teacher: dict | None = None, grouped: bool = False,
               shared_rows: int = 1) -> dict:
    """Per phase `{"measured_s", "light_s", "fraction"}` (light / measured) for the phases in `measured` (the
    run's `timing_s/*` medians: gen, old_log_prob, ref, update_actor, and teacher: the forward of a distillation
    teacher of shape `teacher` over the same tokens) and a `step` total: the
    phases' light summed over the whole measured step. light_s is None on a device without rates (CPU).
    gen and step also carry the touched bound (`touched_light_s`, `touched_fraction`: the decode reading the
    experts a step's batch touches), and gen `active_fraction_ceiling` (light_s / touched_light_s: the most of the
    active bound that reading them allows); the same as the active figures for a dense shape.
    With `gpus` > 1: the FLOPs spread over all of them, the rollout as data-parallel replicas of one GPU each
    (the sequences split evenly). `grouped` (the run's `actor.use_prefix_grouper`): the old-log-prob, reference and
    update passes compute each prompt once for its `n` sequences, and their bounds count that work (`grouped` is set
    in the result); `shared_rows`: the decode reads a prompt's K/V once for so many rows (`decode_seconds`; set in the
    result's gen row where above 1)."""
    flops, bw = device_rates(device)
    seqs = prompts * n
    light: dict = {}
    if flops and bw:
        pre = prefill_seconds(shape, prompts, prompt_len, gpus * flops)
        dec = decode_seconds(shape, math.ceil(seqs / gpus), prompt_len, response_len, bw, flops, max_num_seqs,
                             shared_rows=shared_rows)
        dec_touched = decode_seconds(shape, math.ceil(seqs / gpus), prompt_len, response_len, bw, flops,
                                     max_num_seqs, touched=True, shared_rows=shared_rows)
        per = n if grouped else None
        light = {"gen": pre + dec,
                 "old_log_prob": log_prob_seconds(shape, seqs, prompt_len, response_len, gpus * flops, per),
                 "ref": log_prob_seconds(shape, seqs, prompt_len, response_len, gpus * flops, per),
                 "update_actor": update_seconds(shape, seqs, prompt_len, response_len, gpus * flops, checkpointing,
                                                per)}
        if teacher is not None:
            light["teacher"] = log_prob_seconds(teacher, seqs, prompt_len, response_len, gpus * flops)
    out = {phase: _row(measured[phase], light.get(phase)) for phase in PHASES if measured.get(phase) is not None}
    if "gen" in out and light:
        touched = _row(out["gen"]["measured_s"], pre + dec_touched)
        out["gen"].update(prefill_light_s=pre, decode_light_s=dec, decode_touched_light_s=dec_touched,
                          touched_light_s=touched["light_s"], touched_fraction=touched["fraction"],
                          active_fraction_ceiling=(pre + dec) / (pre + dec_touched))
        if shared_rows > 1:
            out["gen"]["shared_prompt_rows"] = shared_rows
    total = sum(r["light_s"] for r in out.values()) if light else None
    out["step"] = _row(step_s, total)
    if "gen" in out and light:
        touched = _row(step_s, total - out["gen"]["light_s"] + out["gen"]["touched_light_s"])
        out["step"].update(touched_light_s=touched["light_s"], touched_fraction=touched["fraction"])
    out["rates"] = {"matmul_flops_per_s": flops, "hbm_bytes_per_s": bw, "gpus": gpus,
                    "source": RATES_SOURCE if light else "no rates for this device"}
    if grouped:
        out["grouped"] = True
    return out


def _row(measured: float | None, light: float | None) -> dict:
    return {"measured_s": measured, "light_s": light,
            "fraction": light / measured if light is not None and measured else None}
