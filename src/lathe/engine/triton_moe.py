"""A MoE layer's experts at decode sizes in two Triton launches: the engine's decode path for the experts
(`lathe.models.moe.SparseMoeBlock.decode_experts`), the same sum as `lathe.models.moe.experts_forward` for the plain
SwiGLU experts without biases (Qwen3-MoE, Qwen3.5-MoE), for GPT-OSS's (`lathe.models.gpt_oss`: biases, the
clamped SwiGLU, input-major weights; its decode layer reads all its experts' weights like the others', and the
engine's probe keeps the fused path only where it measures it faster) and for Nemotron-H's (`lathe.models.nemotron_h`:
one up projection and relu² in place of gate, up and SwiGLU).

Why: at a decode step of a few hundred rows every expert is touched, so the layer is bound by reading all the
experts' weights once. `experts_forward` sorts the (token, choice) rows by expert, gathers them, runs one grouped
matmul per projection with SwiGLU between, scatters the outputs back and sums each token's k: about ten launches,
and the gather, scatter and intermediates cost a fifth of the layer on top of the matmuls. Here (the design of vLLM's
fused_moe, written anew):
- torch sorts the T*k (token, choice) rows by expert (one small sort) and finds each expert's run of rows
  (`searchsorted`), on the device: nothing is read on the host, so the launches are captured by a decode graph;
- each launch's programs cover (a block of up to BLOCK_M rows of one expert) x (a tile of BLOCK_N output
  features); a program finds its expert and rows itself from the E run bounds (an expert of c rows has ceil(c /
  BLOCK_M) blocks, laid end to end in expert order), so BLOCK_M is a free tuning parameter and the grid is static:
  at most ceil(T*k / BLOCK_M) + min(E, T*k) blocks, and programs past the real count exit at once;
- `_gate_up_kernel` gathers its rows of x by token index inside the kernel, multiplies them by the expert's gate
  and up rows of its tile (each weight tile read once per block) and writes SiLU(gate) * up (GPT-OSS: below),
  (T*k, I) in sorted order;
- `_down_kernel` multiplies each block's intermediate rows by the expert's down projection and by each row's routing
  weight and writes the result at the row's (token, choice) place, (T*k, H); torch sums each token's k rows. No
  atomic adds anywhere: the result is the same on every run.

GPT-OSS's and Nemotron-H's experts run in the same kernels, switched by constexprs (one compiled variant each; the
Qwen variant's code is what it was): the weights are read through strides, so GPT-OSS's input-major tensors ((E, H,
2I), (E, I, H)) go in as the transposed views `experts_forward` takes, without a copy; `CLAMPED` reads gate and up
interleaved (even and odd columns) as one tile of 2 BLOCK_N adjacent columns (contiguous loads, one `tl.dot`) split
after the sum over K, and applies the clamped SwiGLU (`clamped_swiglu`); `HAS_BIAS` adds the gate/up bias before the
activation and the down bias before the routing weight, as `experts_forward` does (a token's output is sum_j w_j
(down_j h + b_j)); `RELU2` reads one up tile (Nemotron-H's up_proj (E, I, H) in gate_up's place) and applies relu².

Tile sizes are autotuned (`triton.autotune`) per bucket of T*k rows and per expert shape: the first call at a new
bucket times the candidate configurations, which must not happen inside a CUDA graph's capture. The engine's probe
(`choose_moe_backend`) runs every bucket of its decode batches first, and a decode graph's eager warm-up run would
too. Under Triton's CPU interpreter (the tests) one fixed small configuration runs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lathe import device as accel
from lathe.engine import choices, triton_decode
from lathe.engine.paged_attention import pick_fastest
from lathe.models.gpt_oss import GptOssExperts
from lathe.models.moe import Experts, SparseMoeBlock, experts_forward, sparse_blocks
from lathe.models.nemotron_h import NemotronExperts, relu2

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs: the experts run as `experts_forward`
    triton = None

MOE_CANDIDATES = ("triton_fused", "experts_forward")      # what the engine times on CUDA, in this order
PROBE_AGREEMENT = 2e-2      # the fused outputs' largest norm-relative distance from experts_forward's at the probe
INTERPRETER_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
PROBE_ROWS = 256        # the decode batch the engine's probe times the candidates at


def rows_bucket(rows: int) -> int:
    """The autotuning key of T*k rows: the next power of 4 from 8 (8, 32, 128, 512, 2048, 8192, ...), so that a
    decode engine's batches (1 to 512 tokens) tune a handful of times, not once per batch size."""
    bucket = 8
    while bucket < rows:
        bucket *= 4
    return bucket


if triton is not None:
    @triton.jit
    def _tile(BOUNDS, num_experts, N, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """(expert, row offsets, row mask, column offsets, column mask) of this program's tile: row block
        program_id // (column tiles), column tile program_id % (column tiles) of N (`_block_rows`)."""
        pid = tl.program_id(0)
        tiles = tl.cdiv(N, BLOCK_N)
        e, rows, row_ok = _block_rows(BOUNDS, pid // tiles, num_experts, E_PAD, BLOCK_M)
        n = (pid % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        return e, rows, row_ok, n, n < N

    @triton.jit
    def _block_rows(BOUNDS, b, num_experts, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """(expert, row offsets, row mask) of block `b`: each expert's run of sorted rows (BOUNDS[e]..BOUNDS[e+1])
        cut into blocks of BLOCK_M, the experts' blocks end to end; expert >= num_experts past the last block."""
        ex = tl.arange(0, E_PAD)
        real = ex < num_experts
        lo = tl.load(BOUNDS + ex, mask=real, other=0)
        hi = tl.load(BOUNDS + ex + 1, mask=real, other=0)
        blocks = (hi - lo + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(blocks, 0)
        e = tl.sum((ends <= b).to(tl.int32), 0)
        pick = ex == e
        first_block = tl.sum(tl.where(pick, ends - blocks, 0), 0)
        start = tl.sum(tl.where(pick, lo, 0), 0) + (b - first_block) * BLOCK_M
        end = tl.sum(tl.where(pick, hi, 0), 0)
        rows = start + tl.arange(0, BLOCK_M)
        return e, rows, rows < end

    @triton.jit
    def _dot(a, b, acc, F32: tl.constexpr):
        """acc + a @ b; `F32`: in float32 (Triton's CPU interpreter multiplies bfloat16 tiles wrongly)."""
        if F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        return tl.dot(a, b, acc)

    @triton.jit
    def _rows_by_tile(x_ptr, w_ptr, row_ok, col_ok, K, stride_xk, stride_wk, BLOCK_M: tl.constexpr,
                      WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr):
        """The float32 (BLOCK_M, WIDTH) product of the rows at x_ptr (BLOCK_M, BLOCK_K: row_ok) and the weight tile at
        w_ptr (BLOCK_K, WIDTH: col_ok), over K in steps of BLOCK_K."""
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = kk < K - k0
            xs = tl.load(x_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(xs, tl.load(w_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0), acc, F32)
            x_ptr += BLOCK_K * stride_xk
            w_ptr += BLOCK_K * stride_wk
        return acc

    @triton.jit
    def _gate_up_kernel(X, W, B, BOUNDS, ORDER, INTER, num_experts, rows_key, N, K, alpha, limit,
                        stride_xt, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_it,
                        TOP_K: tl.constexpr, E_PAD: tl.constexpr, F32: tl.constexpr, HAS_BIAS: tl.constexpr,
                        CLAMPED: tl.constexpr, RELU2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        """INTER[r, n] = act(gate, up) for each sorted row r of expert e, token t, with gate = x[t] . W[e, n] and
        up = x[t] . W[e, N + n] (+ B[e, n], B[e, N + n] when HAS_BIAS), act = silu(gate) * up; CLAMPED: GPT-OSS's
        experts, gate = x[t] . W[e, 2n] and up = x[t] . W[e, 2n + 1] (interleaved, + bias), act its clamped SwiGLU
        (`lathe.models.gpt_oss.clamped_swiglu`); RELU2: Nemotron-H's experts, no gate: relu(up)^2 with up = x[t] .
        W[e, n] (+ B[e, n]), W (E, N, K). W[e, j, k] at W + e stride_we + j stride_wn + k stride_wk."""
        e, rows, row_ok, n, n_ok = _tile(BOUNDS, num_experts, N, E_PAD, BLOCK_M, BLOCK_N)
        if e >= num_experts:
            return
        tokens = tl.load(ORDER + rows, mask=row_ok, other=0) // TOP_K
        kk = tl.arange(0, BLOCK_K)
        x_ptr = X + tokens[:, None].to(tl.int64) * stride_xt + kk[None, :] * stride_xk
        if CLAMPED:     # one tile of 2 BLOCK_N adjacent columns (gate, up, gate, ...), split after the sum over K
            c = (tl.program_id(0) % tl.cdiv(N, BLOCK_N)) * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
            c_ok = c < 2 * N
            w_ptr = W + e.to(tl.int64) * stride_we + c[None, :] * stride_wn + kk[:, None] * stride_wk
            acc = _rows_by_tile(x_ptr, w_ptr, row_ok, c_ok, K, stride_xk, stride_wk, BLOCK_M, 2 * BLOCK_N, BLOCK_K,
                                F32)
            if HAS_BIAS:
                acc += tl.load(B + e.to(tl.int64) * stride_be + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            h = (up + 1) * gate * tl.sigmoid(alpha * gate)
        elif RELU2:
            w_ptr = W + e.to(tl.int64) * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk
            up = _rows_by_tile(x_ptr, w_ptr, row_ok, n_ok, K, stride_xk, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, F32)
            if HAS_BIAS:
                up += tl.load(B + e.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            up = tl.maximum(up, 0.0)
            h = up * up
        else:
            g_ptr = W + e.to(tl.int64) * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk
            u_ptr = g_ptr + N * stride_wn
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = kk < K - k0
                xs = tl.load(x_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w_ok = k_ok[:, None] & n_ok[None, :]
                gate = _dot(xs, tl.load(g_ptr, mask=w_ok, other=0.0), gate, F32)
                up = _dot(xs, tl.load(u_ptr, mask=w_ok, other=0.0), up, F32)
                x_ptr += BLOCK_K * stride_xk
                g_ptr += BLOCK_K * stride_wk
                u_ptr += BLOCK_K * stride_wk
            if HAS_BIAS:
                b_ptr = B + e.to(tl.int64) * stride_be + n
                gate += tl.load(b_ptr, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                up += tl.load(b_ptr + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            h = gate * tl.sigmoid(gate) * up
        tl.store(INTER + rows[:, None].to(tl.int64) * stride_it + n[None, :], h.to(INTER.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _down_kernel(INTER, W, B, BOUNDS, ORDER, RW, OUT, num_experts, rows_key, N, K,
                     stride_it, stride_we, stride_wn, stride_wk, stride_be, stride_ot,
                     E_PAD: tl.constexpr, F32: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """OUT[s, n] = RW[s] * (INTER[r] . W[e, n] (+ B[e, n] when HAS_BIAS)) for each sorted row r of expert e, s
        its (token, choice) index: the bias inside the routing weight, as `experts_forward` adds it."""
        e, rows, row_ok, n, n_ok = _tile(BOUNDS, num_experts, N, E_PAD, BLOCK_M, BLOCK_N)
        if e >= num_experts:
            return
        slots = tl.load(ORDER + rows, mask=row_ok, other=0)
        kk = tl.arange(0, BLOCK_K)
        a_ptr = INTER + rows[:, None].to(tl.int64) * stride_it + kk[None, :]
        w_ptr = W + e.to(tl.int64) * stride_we + n[None, :] * stride_wn + kk[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = kk < K - k0
            a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(a, tl.load(w_ptr, mask=k_ok[:, None] & n_ok[None, :], other=0.0), acc, F32)
            a_ptr += BLOCK_K
            w_ptr += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(B + e.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc = acc * tl.load(RW + slots, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(OUT + slots[:, None].to(tl.int64) * stride_ot + n[None, :], acc.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])

    def _prune(configs, named_args, **kwargs):
        """Drop row blocks far larger than an expert's expected rows (T*k / E, doubled for the spread): they only
        multiply padding. BLOCK_M 16 is always kept (tl.dot's least)."""
        args = {**named_args, **kwargs}
        per_expert = 2 * args["rows_key"] / max(1, args["num_experts"])
        kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, per_expert)]
        return kept or configs[:1]

    # (BLOCK_N, BLOCK_K, warps, stages) at each BLOCK_M of 16, 32, 64 (`_prune` keeps those a bucket can fill)
    _TILES = ((64, 128, 4, 4), (128, 64, 4, 4), (64, 64, 4, 3), (128, 128, 8, 3))
    CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
               for m in (16, 32, 64) for n, k, w, s in _TILES]
    def _tune(*variant):
        return triton.autotune(CONFIGS, key=["rows_key", "N", "K", "HAS_BIAS", *variant],
                               prune_configs_by={"early_config_prune": _prune})
    # (gate/up's activation in its key: GPT-OSS's, Nemotron-H's and a plain layer's kernels of one shape tuned apart)
    _gate_up_tuned, _down_tuned = _tune("CLAMPED", "RELU2")(_gate_up_kernel), _tune()(_down_kernel)


def _blocks(rows: int, num_experts: int, block_m: int) -> int:
    """The static bound on the row blocks (module doc)."""
    return triton.cdiv(rows, block_m) + min(num_experts, rows)


def _launch(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None, clamp: tuple[float, float] | None,
            config: dict | None, relu2: bool = False) -> torch.Tensor:
    tokens, top_k = chosen.shape
    e, inter, hidden = gate_up.shape[0], down.shape[2], down.shape[1]
    rows = tokens * top_k
    if rows == 0:
        return torch.zeros_like(x)
    experts, order = chosen.reshape(-1).to(torch.int32).sort(stable=True)
    bounds = torch.searchsorted(experts, torch.arange(e + 1, device=x.device, dtype=torch.int32), out_int32=True)
    mid = x.new_empty(rows, inter)
    ys = x.new_empty(rows, hidden)
    e_pad, key = triton.next_power_of_2(e), rows_bucket(rows)
    interpreted = triton_decode.interpreted()
    if config is None and interpreted:
        config = INTERPRETER_CONFIG
    gate_up_kernel, down_kernel = (_gate_up_tuned, _down_tuned) if config is None else (_gate_up_kernel, _down_kernel)
    meta = {**(config or {}), "E_PAD": e_pad, "F32": interpreted, "HAS_BIAS": biases is not None}
    b_gate_up, b_down = (gate_up, down) if biases is None else biases       # (not read without biases)
    alpha, limit = clamp or (1.0, 0.0)

    def grid(n):
        return lambda m: (_blocks(rows, e, m["BLOCK_M"]) * triton.cdiv(n, m["BLOCK_N"]),)
    gate_up_kernel[grid(inter)](x, gate_up, b_gate_up, bounds, order, mid, e, key, inter, hidden, alpha, limit,
                                x.stride(0), x.stride(1), *gate_up.stride(), b_gate_up.stride(0), mid.stride(0),
                                TOP_K=top_k, CLAMPED=clamp is not None, RELU2=relu2, **meta)
    down_kernel[grid(hidden)](mid, down, b_down, bounds, order, weights.reshape(-1).contiguous(), ys, e, key, hidden,
                              inter, mid.stride(0), *down.stride(), b_down.stride(0), ys.stride(0), **meta)
    return ys.view(tokens, top_k, hidden).sum(1)


if triton is not None:
    # One operator, opaque to torch.compile: the engine's compiled layers call it without a graph break and without
    # tracing the launches (the fake gives the output's shape).
    @torch.library.custom_op("lathe::moe_fused_experts", mutates_args=())
    def _fused_op(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                  clamped: bool, alpha: float, limit: float, relu2: bool) -> torch.Tensor:
        biases = None if gate_up_bias is None else (gate_up_bias, down_bias)
        return _launch(x, weights, chosen, gate_up, down, biases, (alpha, limit) if clamped else None, None, relu2)

    @_fused_op.register_fake
    def _(x, weights, chosen, gate_up, down, gate_up_bias, down_bias, clamped, alpha, limit, relu2):
        return torch.empty_like(x)


def fused_experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                  clamp: tuple[float, float] | None = None, config: dict | None = None, *,
                  relu2: bool = False) -> torch.Tensor:
    """`experts_forward(x, weights, chosen, gate_up, down, biases, act)` in two Triton launches (module doc): x (T,
    H), weights (T, k) (any float type), chosen (T, k) expert ids, gate_up (E, 2I, H) and down (E, H, I) as
    `experts_forward` takes them (any strides: GPT-OSS's transposed input-major tensors as they are), `biases` (E,
    2I), (E, H) or None. `clamp`: None for SwiGLU over gate rows then up rows; GPT-OSS's (alpha, limit) for its
    clamped SwiGLU over interleaved gate and up rows (act = `lathe.models.gpt_oss.clamped_swiglu`). `relu2`:
    Nemotron-H's experts, without a gate: gate_up is the up projection (E, I, H), act = relu(up)^2
    (`lathe.models.nemotron_h.relu2`). `config` ({BLOCK_M, BLOCK_N, BLOCK_K}): fixed tiles instead of the
    autotuned ones (tests)."""
    if relu2 and clamp is not None:
        raise ValueError("fused_experts: relu2 and clamp are two activations; give one")
    if config is not None:
        return _launch(x, weights, chosen, gate_up, down, biases, clamp, config, relu2)
    gate_up_bias, down_bias = (None, None) if biases is None else biases
    alpha, limit = clamp or (1.0, 0.0)
    return _fused_op(x, weights, chosen, gate_up, down, gate_up_bias, down_bias, clamp is not None, alpha, limit,
                     relu2)


def last_configs() -> dict[str, str]:
    """The tiles the autotuner picked for each kernel's latest launch (benchmarks report them)."""
    return {name: str(getattr(kernel, "best_config", None)) for name, kernel in
            (("gate_up", _gate_up_tuned), ("down", _down_tuned))}


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the engine may run the fused kernels here: Triton on CUDA, in half precision (in float32 `tl.dot`
    would round to TF32, below what a float32 model asks for)."""
    return triton is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def fusable_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The sparse layers whose experts the fused kernels compute: the plain SwiGLU experts without biases
    (`Experts`: Qwen3-MoE's, Qwen3.5-MoE's, DeepSeek-V3's and GLM-4.5's), GPT-OSS's (`GptOssExperts`) and
    Nemotron-H's relu² experts (`NemotronExperts`), not an expert-parallel slice (every block's forward reads
    `decode_experts`)."""
    return [b for b in sparse_blocks(model) if type(b.experts) in (Experts, GptOssExperts, NemotronExperts)]


def experts_args(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor, tuple | None, tuple[float, float] | None]:
    """(gate_up, down, biases, clamp): the arguments after (x, weights, chosen) with which `fused_experts` computes
    `experts`' sum (a fusable block's), as its block's forward passes them; `experts_kwargs` the keywords."""
    if isinstance(experts, GptOssExperts):
        return *experts.linear(), experts.biases(), (experts.alpha, experts.limit)
    if isinstance(experts, NemotronExperts):
        return experts.up_proj, experts.down_proj, None, None
    return experts.gate_up_proj, experts.down_proj, None, None


def experts_kwargs(experts: nn.Module) -> dict[str, bool]:
    """The keywords of `fused_experts` for `experts` beside `experts_args`: relu2 for Nemotron-H's."""
    return {"relu2": True} if isinstance(experts, NemotronExperts) else {}


def set_decode_experts(blocks: list[SparseMoeBlock], on: bool) -> None:
    """Route `blocks`' experts (from `fusable_blocks`) through `fused_experts` (on) or back to `experts_forward`:
    the engine turns it on for its decode steps and off around a prefill."""
    for block in blocks:
        block.decode_experts = fused_experts if on else None


def _time(fn, device: torch.device, repeats: int = 5) -> float:
    fn()
    accel.synchronize(device)
    start, end = accel.new_event(device, timing=True), accel.new_event(device, timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    accel.synchronize(device)
    return start.elapsed_time(end) / repeats


def choose_moe_backend(model: nn.Module, max_rows: int) -> tuple[str | None, dict[str, float]]:
    """The experts' decode path of `model` by measurement: on CUDA with Triton, for a model whose sparse layers
    are all fusable (`fusable_blocks`), `fused_experts` and `experts_forward` are timed on the first layer's own
    weights at a decode batch of min(`PROBE_ROWS`, `max_rows`) tokens with random routing, and the faster is kept
    (logged, as `pick_fastest` logs); the fused path is not chosen when its outputs there differ from
    `experts_forward`'s by more than `PROBE_AGREEMENT` (a kernel the tests ran only under Triton's interpreter, or a
    GPU where it builds but computes wrongly, cannot slip in). Before that, the fused kernels are tuned at every row
    bucket up to `max_rows` (the engine's largest decode batch), so that no tuning runs during a decode graph's
    capture. Returns ("triton_fused" or "experts_forward", {candidate: ms per call}); "experts_forward" and no times
    where there is no choice; (None, {}) for a model without sparse layers."""
    blocks, all_blocks = fusable_blocks(model), sparse_blocks(model)
    if not all_blocks:
        return None, {}
    if len(blocks) != len(all_blocks):
        return "experts_forward", {}
    experts = blocks[0].experts
    gate_up, down, biases, clamp = experts_args(experts)
    keywords = experts_kwargs(experts)
    if not usable(gate_up.device, gate_up.dtype):
        return "experts_forward", {}
    e, h, k = gate_up.shape[0], gate_up.shape[2], blocks[0].moe.num_experts_per_tok
    g = torch.Generator(device=gate_up.device).manual_seed(0)

    def inputs(tokens):
        x = torch.randn(tokens, h, device=gate_up.device, dtype=gate_up.dtype, generator=g)
        chosen = torch.rand(tokens, e, device=gate_up.device, generator=g).topk(k, dim=-1).indices
        weights = torch.rand(tokens, k, device=gate_up.device, generator=g).softmax(-1).to(gate_up.dtype)
        return x, weights, chosen

    def tune():                     # every bucket a decode batch of up to max_rows tokens meets
        tokens = 1
        while True:
            fused_experts(*inputs(tokens), gate_up, down, biases, clamp, **keywords)
            if rows_bucket(tokens * k) >= rows_bucket(max_rows * k):
                return
            tokens = rows_bucket(tokens * k) * 4 // k

    probe = inputs(min(PROBE_ROWS, max_rows))
    act = relu2 if keywords.get("relu2") else None if clamp is None else experts.act
    runs = {"triton_fused": lambda: fused_experts(*probe, gate_up, down, biases, clamp, **keywords),
            "experts_forward": lambda: experts_forward(*probe, gate_up, down, biases, act)}

    def time_one(name):
        if name == "triton_fused":
            tune()
            agree(runs[name](), runs["experts_forward"]())
        return _time(runs[name], gate_up.device)

    def agree(fused, reference):    # a kernel that builds but computes another sum is never chosen
        err = float((fused.float() - reference.float()).norm() / reference.float().norm().clamp_min(1e-12))
        if not err <= PROBE_AGREEMENT:
            raise RuntimeError(f"its outputs differ from experts_forward's by {err:.3g} (norm-relative, more than "
                               f"{PROBE_AGREEMENT})")
    # (the variant is part of the key: GPT-OSS's experts, with biases and a clamped SwiGLU, run other kernels than a
    # Qwen3-MoE's of the same shape, and must not take the choice measured on those)
    variant = "".join((", biases" if biases is not None else "", ", clamped SwiGLU" if clamp is not None else "",
                       ", relu² without a gate" if keywords.get("relu2") else ""))
    shape = f"{gate_up.dtype}, {e} experts of {h}x{down.shape[2]}, top-{k}{variant}"
    measured = f"MoE experts at decode ({shape}, {min(PROBE_ROWS, max_rows)} rows, tuned to {max_rows})"
    with torch.inference_mode():
        return pick_fastest(MOE_CANDIDATES, time_one, f"MoE experts at decode on {gate_up.device} ({shape})",
                            remember=choices.key(measured, gate_up.device))
