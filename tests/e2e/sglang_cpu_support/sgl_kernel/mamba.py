"""TEST SUPPORT FOR THE HOST ENGINE, not kvplan: the linear-attention (gated delta net) CPU ops
SGLang 0.5.23 calls for a Qwen3-Next model on a CPU, in plain PyTorch.

SGLang's CPU path for GDN layers (``layers/attention/linear/gdn_backend.py`` and
``kernels/gdn_triton.py``) imports ``causal_conv1d_fn_cpu``, ``causal_conv1d_update_cpu`` and
``chunk_gated_delta_rule_cpu`` from ``sgl_kernel.mamba`` and reads
``torch.ops.sgl_kernel.fused_gdn_gating_cpu`` and
``torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu`` at import time. This module
registers those torch ops (with sgl-kernel's CPU schemas, so SGLang's keyword calls bind the
same way) and gives the Python wrappers sgl-kernel's ``mamba`` module has, with the same
arguments.

What is computed is the real thing, not a placeholder: a prefill leaves in the pool exactly
the state a decode continues from, and that state is what a prefill/decode pair transfers.

* Causal conv1d (prefill, varlen): per sequence, the ``W - 1`` columns before it are its
  ``conv_states`` slot when ``has_initial_state`` is set, zeros otherwise; the output is the
  depthwise convolution (plus bias, then SiLU when asked); afterwards the slot holds the
  sequence's last ``W - 1`` inputs (with the earlier state in front when it is shorter).
* Causal conv1d (decode): the window is the slot followed by the new input; the slot shifts by
  one column.
* Gated delta rule, per token and value head, state ``S`` of ``[K, V]`` (float32): ``S *=
  exp(g)``; ``delta = (v - k.S) * beta``; ``S += k (x) delta``; ``o = (q * K**-0.5).S``, with
  ``q`` and ``k`` L2-normalised first when asked. Prefill (``chunk_gated_delta_rule_cpu``)
  reads each sequence's slot and writes the final state back into it; decode
  (``fused_sigmoid_gating_delta_rule_update_cpu``) does the same one token at a time, taking
  ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` itself. The prefill runs
  the recurrence token by token where sgl-kernel's kernel uses the equivalent chunked form.

Tensors are taken as SGLang hands them over without AMX: conv weights ``[dim, W]`` (not
VNNI-prepacked; ``is_vnni`` is accepted and ignored), conv states ``[slots, dim, W - 1]`` in any
dtype (the arithmetic is float32, the slot keeps its dtype), recurrent states
``[slots, HV, K, V]`` float32, activations in the model's dtype (float32 here). A slot index
equal to ``pad_slot_id`` is skipped, as in the kernels.

Only the end-to-end test puts this directory on ``PYTHONPATH``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# A fragment: the namespace is sgl-kernel's, and other test support may add to it.
_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")


def _op(schema: str):
    """Define ``sgl_kernel::<schema>`` and register the decorated function as its CPU kernel."""

    def register(fn):
        _LIB.define(schema)
        _LIB.impl(schema.split("(", 1)[0], fn, "CPU")
        return fn

    return register


def _l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# --------------------------------------------------------------------------------------------
# Causal conv1d


@_op("causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor? conv_states, "
     "Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, "
     "bool silu_activation, int pad_slot_id, bool is_vnni) -> Tensor")
def _causal_conv1d_fwd_cpu(x, weight, bias, conv_states, query_start_loc, cache_indices,
                           has_initial_state, silu_activation, pad_slot_id, is_vnni):
    """``x``: ``[dim, tokens]`` (all sequences back to back, split by ``query_start_loc``)."""
    del is_vnni
    dim, tokens = x.shape
    width = weight.shape[-1]
    w = weight.reshape(dim, width).float()
    out = torch.zeros_like(x)
    if query_start_loc is None:
        starts = [0, tokens]
    else:
        starts = [int(s) for s in query_start_loc.tolist()]
    for seq in range(len(starts) - 1):
        begin, end = starts[seq], starts[seq + 1]
        if end <= begin:
            continue
        slot = int(cache_indices[seq]) if cache_indices is not None else seq
        if conv_states is not None and slot == pad_slot_id:
            continue
        initial = has_initial_state is not None and bool(has_initial_state[seq])
        if conv_states is not None and initial:
            before = conv_states[slot].float()
        else:
            before = x.new_zeros((dim, width - 1), dtype=torch.float32)
        window = torch.cat([before, x[:, begin:end].float()], dim=1)  # [dim, W - 1 + L]
        y = F.conv1d(window.unsqueeze(0), w.unsqueeze(1), None if bias is None else bias.float(),
                     groups=dim).squeeze(0)
        if silu_activation:
            y = F.silu(y)
        out[:, begin:end] = y.to(out.dtype)
        if conv_states is not None:
            conv_states[slot] = window[:, -(width - 1):].to(conv_states.dtype)
    return out


@_op("causal_conv1d_update_cpu(Tensor x, Tensor conv_states, Tensor weight, Tensor? bias, "
     "bool silu_activation, Tensor? cache_seqlens, Tensor? conv_state_indices, int pad_slot_id, "
     "bool is_vnni) -> Tensor")
def _causal_conv1d_update_cpu(x, conv_states, weight, bias, silu_activation, cache_seqlens,
                              conv_state_indices, pad_slot_id, is_vnni):
    """``x``: ``[batch, dim]`` (one token each) or ``[batch, dim, L]``; each row's slot
    ``conv_state_indices[row]`` (row ``i`` when absent) rolls forward by its tokens."""
    del is_vnni
    if cache_seqlens is not None:
        raise NotImplementedError("causal_conv1d_update_cpu stand-in: cache_seqlens "
                                  "(circular conv states) is not used by SGLang's CPU path")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    batch, dim, length = xs.shape
    width = weight.shape[-1]
    w = weight.reshape(dim, width).float()
    out = torch.zeros_like(xs)
    for row in range(batch):
        slot = int(conv_state_indices[row]) if conv_state_indices is not None else row
        if slot == pad_slot_id:
            continue
        window = torch.cat([conv_states[slot].float(), xs[row].float()], dim=1)
        y = F.conv1d(window.unsqueeze(0), w.unsqueeze(1), None if bias is None else bias.float(),
                     groups=dim).squeeze(0)
        if silu_activation:
            y = F.silu(y)
        out[row] = y.to(out.dtype)
        conv_states[slot] = window[:, -(width - 1):].to(conv_states.dtype)
    return out.squeeze(-1) if squeeze else out


# --------------------------------------------------------------------------------------------
# Gating and the gated delta rule


def _softplus(x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    return F.softplus(x, beta=beta, threshold=threshold)


@_op("fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)")
def _fused_gdn_gating_cpu(A_log, a, b, dt_bias):
    """``a``, ``b``: ``[tokens, HV]``. Returns ``g = -exp(A_log) * softplus(a + dt_bias)``
    (float32) and ``beta = sigmoid(b)`` (``b``'s dtype), each ``[1, tokens, HV]``."""
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float(), 1.0, 20.0)
    beta = torch.sigmoid(b.float()).to(b.dtype)
    return g.unsqueeze(0), beta.unsqueeze(0)


def _delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token for every value head: ``state`` ``[HV, K, V]`` (updated in place), ``q``/``k``
    ``[HV, K]`` (already normalised and scaled), ``v`` ``[HV, V]``, ``g``/``beta`` ``[HV]``.
    Returns ``o`` ``[HV, V]``."""
    state.mul_(torch.exp(g)[:, None, None])
    kv_mem = torch.einsum("hk,hkv->hv", k, state)
    delta = (v - kv_mem) * beta[:, None]
    state.add_(k[:, :, None] * delta[:, None, :])
    return torch.einsum("hk,hkv->hv", q, state)


def _expand_heads(x: torch.Tensor, v_heads: int) -> torch.Tensor:
    """``[..., HK, K]`` to ``[..., HV, K]``: value head ``h`` reads query/key head
    ``h // (HV / HK)``."""
    return x.repeat_interleave(v_heads // x.shape[-2], dim=-2)


@_op("chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, "
     "Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first, "
     "bool use_qk_l2norm_in_kernel, Tensor? initial_state_indices, float eps=1e-6) "
     "-> (Tensor, Tensor)")
def _chunk_gated_delta_rule_cpu(query, key, value, g, beta, initial_state, output_final_state,
                                cu_seqlens, head_first, use_qk_l2norm_in_kernel,
                                initial_state_indices, eps=1e-6):
    """``query``/``key`` ``[1, T, HK, K]``, ``value`` ``[1, T, HV, V]``, ``g``/``beta``
    ``[1, T, HV]``, ``initial_state`` ``[slots, HV, K, V]`` float32, ``cu_seqlens`` ``[N + 1]``.
    Sequence ``n`` starts from slot ``initial_state_indices[n]`` (``n`` when absent) and leaves
    its final state there. Returns the output ``[1, T, HV, V]`` and the final states
    ``[N, HV, K, V]``."""
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule_cpu does not support head_first")
    del output_final_state  # the states are always written back (SGLang reads the pool)
    hv = value.shape[2]
    scale = query.shape[-1] ** -0.5
    q = query[0].float()
    k = key[0].float()
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q, eps), _l2norm(k, eps)
    q = _expand_heads(q * scale, hv)
    k = _expand_heads(k, hv)
    v = value[0].float()
    gg = g[0].float()
    bb = beta[0].float()
    out = torch.zeros_like(value)
    starts = [int(s) for s in cu_seqlens.tolist()]
    finals = []
    for seq in range(len(starts) - 1):
        slot = int(initial_state_indices[seq]) if initial_state_indices is not None else seq
        state = initial_state[slot].float().clone()
        for t in range(starts[seq], starts[seq + 1]):
            out[0, t] = _delta_rule_step(state, q[t], k[t], v[t], gg[t], bb[t]).to(out.dtype)
        initial_state[slot] = state.to(initial_state.dtype)
        finals.append(state)
    final = torch.stack(finals) if finals else initial_state.new_zeros((0, *initial_state.shape[1:]))
    return out, final


@_op("fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, "
     "Tensor k, Tensor v, Tensor a, Tensor b, Tensor(a!) initial_state_source, "
     "Tensor initial_state_indices, Tensor cu_seqlens, bool use_qk_l2norm_in_kernel, "
     "float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor")
def _fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b,
                                                initial_state_source, initial_state_indices,
                                                cu_seqlens, use_qk_l2norm_in_kernel,
                                                softplus_beta=1.0, softplus_threshold=20.0):
    """Decode: ``q``/``k`` ``[L, batch, HK, K]``, ``v`` ``[L, batch, HV, V]``, ``a``/``b``
    ``[batch, HV]`` (one token per request: ``L`` is 1 on SGLang's decode path),
    ``initial_state_source`` ``[slots, HV, K, V]`` float32, updated in place at
    ``initial_state_indices``. Returns ``[batch, L, HV, V]``."""
    del cu_seqlens  # one sequence per batch row
    length, batch, _, head_k = q.shape
    hv = v.shape[2]
    scale = head_k ** -0.5
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf, kf = _l2norm(qf, 1e-5), _l2norm(kf, 1e-5)
    qf = _expand_heads(qf * scale, hv)
    kf = _expand_heads(kf, hv)
    g = -torch.exp(A_log.float()) * _softplus(a.float() + dt_bias.float(), softplus_beta,
                                              softplus_threshold)
    beta = torch.sigmoid(b.float())
    out = v.new_zeros((batch, length, hv, v.shape[3]))
    for row in range(batch):
        slot = int(initial_state_indices[row])
        if slot < 0:
            continue
        state = initial_state_source[slot].float().clone()
        for t in range(length):
            out[row, t] = _delta_rule_step(state, qf[t, row], kf[t, row], v[t, row].float(),
                                           g[row], beta[row]).to(out.dtype)
        initial_state_source[slot] = state.to(initial_state_source.dtype)
    return out


# --------------------------------------------------------------------------------------------
# sgl-kernel's Python wrappers (``sgl_kernel.mamba``), as SGLang calls them


def causal_conv1d_fn_cpu(mixed_qkv_transposed: torch.Tensor, conv_weights: torch.Tensor,
                         bias: Optional[torch.Tensor], activation: Optional[str],
                         conv_states: torch.Tensor, has_initial_state: torch.Tensor,
                         cache_indices: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens_cpu: object = None) -> torch.Tensor:
    del seq_lens_cpu  # the op splits by query_start_loc
    return torch.ops.sgl_kernel.causal_conv1d_fwd_cpu(
        mixed_qkv_transposed, conv_weights, bias, conv_states, query_start_loc, cache_indices,
        has_initial_state, activation == "silu", -1, True)


def causal_conv1d_update_cpu(mixed_qkv: torch.Tensor, conv_states: torch.Tensor,
                             conv_weights: torch.Tensor, bias: Optional[torch.Tensor],
                             activation: Optional[str], conv_state_indices: torch.Tensor,
                             intermediate_conv_window: object = None,
                             intermediate_state_indices: object = None,
                             retrieve_next_token: object = None,
                             retrieve_next_sibling: object = None,
                             retrieve_parent_token: object = None) -> torch.Tensor:
    if intermediate_conv_window is not None:
        raise NotImplementedError("causal_conv1d_update_cpu stand-in: speculative target "
                                  "verify is not part of the end-to-end test")
    return torch.ops.sgl_kernel.causal_conv1d_update_cpu(
        mixed_qkv, conv_states, conv_weights, bias, activation == "silu", None,
        conv_state_indices, -1, True)


def chunk_gated_delta_rule_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor,
                               cu_seqlens: torch.Tensor, head_first: bool,
                               use_qk_l2norm_in_kernel: bool,
                               initial_state_indices: Optional[torch.Tensor] = None):
    core_attn_out, last_recurrent_state = torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu(
        q, k, v, g, beta, initial_state, True, cu_seqlens, head_first, use_qk_l2norm_in_kernel,
        initial_state_indices)
    return core_attn_out, last_recurrent_state, None  # no per-chunk states (h)


# --------------------------------------------------------------------------------------------


def self_check(seed: int = 0) -> str:
    """The property the prefill/decode test relies on, checked on random tensors: prefilling
    ``n`` tokens leaves the same conv and recurrent states, and gives the same last output, as
    prefilling ``n - 1`` tokens (two sequences in one batch, non-trivial slots) and decoding the
    last one; and a prefill of two sequences equals the two prefills alone. Raises on a
    difference; returns a one-line summary."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    hk, hv, kd, vd, width = 2, 4, 8, 8, 4
    dim = 2 * hk * kd + hv * vd
    weight, bias = rnd(dim, width), rnd(dim)
    a_log, dt_bias = rnd(hv), rnd(hv)
    lens, slots = [7, 12], torch.tensor([3, 1], dtype=torch.int32)

    def fresh():
        return torch.zeros(5, dim, width - 1), torch.zeros(5, hv, kd, vd)

    seqs = [rnd(n, dim) for n in lens]
    gates = [(rnd(n, hv), rnd(n, hv)) for n in lens]

    def prefill(conv, ssm, xs, ab, idx):
        x = torch.cat(xs)
        loc = torch.tensor([0, *torch.tensor([len(s) for s in xs]).cumsum(0).tolist()],
                           dtype=torch.int32)
        y = causal_conv1d_fn_cpu(x.t(), weight, bias, "silu", conv,
                                 torch.zeros(len(xs), dtype=torch.bool), idx, loc).t()
        q, k, v = torch.split(y, [hk * kd, hk * kd, hv * vd], dim=-1)
        g, beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(
            a_log, torch.cat([p[0] for p in ab]), torch.cat([p[1] for p in ab]), dt_bias)
        out, _, _ = chunk_gated_delta_rule_cpu(
            q.reshape(1, -1, hk, kd), k.reshape(1, -1, hk, kd), v.reshape(1, -1, hv, vd), g,
            beta, ssm, loc, False, True, idx)
        return out[0]

    conv_a, ssm_a = fresh()
    whole = prefill(conv_a, ssm_a, seqs, gates, slots)
    conv_b, ssm_b = fresh()
    prefill(conv_b, ssm_b, [s[:-1] for s in seqs], [(a[:-1], b[:-1]) for a, b in gates], slots)
    x = torch.stack([s[-1] for s in seqs])
    y = causal_conv1d_update_cpu(x, conv_b, weight, bias, "silu", slots)
    q, k, v = torch.split(y, [hk * kd, hk * kd, hv * vd], dim=-1)
    out = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=a_log, dt_bias=dt_bias, q=q.reshape(1, 2, hk, kd), k=k.reshape(1, 2, hk, kd),
        v=v.reshape(1, 2, hv, vd), a=torch.stack([a[-1] for a, _ in gates]),
        b=torch.stack([b[-1] for _, b in gates]), initial_state_source=ssm_b,
        initial_state_indices=slots, cu_seqlens=torch.arange(3, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0)
    ends = torch.tensor(lens).cumsum(0) - 1
    checks = {
        "conv states": (conv_a, conv_b),
        "recurrent states": (ssm_a, ssm_b),
        "last outputs": (whole[ends], out[:, 0]),
    }
    for n, slot in enumerate(slots.tolist()):
        conv_c, ssm_c = fresh()
        alone = prefill(conv_c, ssm_c, [seqs[n]], [gates[n]], slots[n:n + 1])
        start = sum(lens[:n])
        checks[f"sequence {n} alone"] = (whole[start:start + lens[n]], alone)
        checks[f"sequence {n} state alone"] = (ssm_a[slot], ssm_c[slot])
    for what, (got, want) in checks.items():
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise AssertionError(f"GDN stand-in: {what} differ (max abs difference "
                                 f"{(got - want).abs().max().item():.3g})")
    if not ssm_a.abs().sum() > 0 or not conv_a[slots.long()].abs().sum() > 0:
        raise AssertionError("GDN stand-in: the prefill left the state slots empty")
    return "GDN stand-in ops: prefill(n) = prefill(n - 1) + decode(1) for conv and recurrent " \
        "states and outputs; batched prefill = prefills alone"
