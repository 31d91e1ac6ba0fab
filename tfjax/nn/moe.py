"""Mixture of Experts feed-forward (Shazeer et al. 2017; GShard; Switch; Mixtral):

    scores = softmax | sigmoid(x @ router + router_bias)   # [B, T, E], float32
    experts = top_k(scores + score_bias, k)  # within the top `topk_group` of `n_group` groups
    gates = scores[experts]                  # / sum(gates) if `router_renormalize`; * routed_scaling
    y = sum_j gates_j * expert_{experts_j}(x) + sigmoid(x @ shared_gate) * shared(x)

`MoE(d_model, d_ff, moe)`: `x [B, T, D] -> [B, T, D]`, dropless (`ragged_dot`, or
dense) or with expert capacity; experts `[E, D, F]`. `moe_aux(model)` reads the
auxiliary losses and metrics after a forward pass; `balance_experts` moves
DeepSeek-V3's loss-free balancing bias once a train step. See docs/layers.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from tfjax.config import MoEConfig
from tfjax.nn.ffn import ACTIVATIONS, FeedForward
from tfjax.nn.hooks import hook, scope
from tfjax.parallel.sharding import shard, with_logical_axes
from tfjax.typing import Array, DType, Float

__all__ = ["MoE", "MoEAux", "MoEBias", "moe_aux", "route", "balance_experts", "capacity_slots",
           "MOE_IMPLEMENTATIONS", "MOE_SCORES", "MOE_GLUS"]

MOE_IMPLEMENTATIONS = ("ragged", "dense")  # dropless dispatch; capacity_factor > 0 always gathers
MOE_SCORES = ("softmax", "sigmoid")
MOE_GLUS = ("standard", "clamped")  # clamped: gpt-oss's SwiGLU


class MoEAux(nnx.Variable):
    """Per-forward MoE statistics (auxiliary losses and metrics), overwritten each call."""


class MoEBias(nnx.Variable):
    """The expert-choice score bias `[E]` (DeepSeek-V3): state, not a Param (no gradient);
    metadata `update_rate` is the aux-loss-free balancing rate (0 = fixed)."""


def route(logits: jax.Array, k: int, renormalize: bool, *, score: str = "softmax",
          bias: jax.Array | None = None, n_group: int = 1, topk_group: int = 1,
          scale: float = 1.0):
    """Router logits `[..., E]` -> (scores `[..., E]`, gates `[..., k]`, experts `[..., k]`).

    `bias` `[E]` moves the choice only; groups: the top `topk_group` of `n_group` groups
    by the sum of their top-2 (biased) scores, then the top k within them.
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if score == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if n_group > 1:
        E = scores.shape[-1]
        grouped = choice.reshape(*choice.shape[:-1], n_group, E // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., n_group]
        top_groups = jax.lax.top_k(group_scores, topk_group)[1]
        kept = jnp.any(top_groups[..., None] == jnp.arange(n_group), axis=-2)  # [..., n_group]
        choice = jnp.where(jnp.repeat(kept, E // n_group, axis=-1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, k)[1]
    gates = jnp.take_along_axis(scores, experts, axis=-1)
    if renormalize:
        eps = 1e-20 if score == "sigmoid" else 0.0  # DeepSeek-V3's guard
        gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + eps)
    if scale != 1.0:
        gates = gates * scale
    return scores, gates, experts.astype(jnp.int32)


def balance_experts(rest: nnx.State) -> nnx.State:
    """DeepSeek-V3's auxiliary-loss-free balancing, once per train step: every `MoEBias`
    with `update_rate` gamma > 0 moves by gamma * sign(mean load - load_e), from the
    sibling `expert_load` of the last forward pass. `rest` is a model's non-Param state
    (`nnx.state(model, nnx.Not(nnx.Param))`); pure, works on scanned `[L, E]` stacks."""
    flat = dict(nnx.to_flat_state(rest))
    changed = False
    for path, var in flat.items():
        rate = getattr(var, "update_rate", 0.0) if isinstance(var, MoEBias) else 0.0
        if not rate:
            continue
        load = flat[path[:-1] + ("expert_load",)][...].astype(jnp.float32)
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        flat[path] = var.replace(value=(var[...] + step).astype(var[...].dtype))
        changed = True
    return nnx.from_flat_state(list(flat.items())) if changed else rest


def capacity_slots(experts: jax.Array, num_experts: int, capacity: int):
    """Slot of each assignment in its expert's buffer, per group.

    experts `[B, T, k]` -> (slot `[B, T, k]` in [0, C), keep `[B, T, k]` bool). Priority:
    choice rank first (every first choice before any second choice), then position.
    """
    B, T, k = experts.shape
    order = experts.swapaxes(1, 2).reshape(B, k * T)  # [B, k*T], rank-major
    onehot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)  # [B, kT, E]
    before = jnp.cumsum(onehot, axis=1) - onehot  # earlier assignments to the same expert
    slot = jnp.sum(before * onehot, axis=-1)  # [B, kT]
    slot = slot.reshape(B, k, T).swapaxes(1, 2)  # [B, T, k]
    return slot, slot < capacity


class MoE(nnx.Module):
    """`[B, T, D] -> [B, T, D]`: a routed mixture of `moe.num_experts` feed-forward
    experts, each `d_ff` wide. `moe` (`tfjax.config.MoEConfig`, its fields as
    docs/layers.md names them): the experts, the router and the dispatch; its
    `d_ff` is not read here (the ffn kind passes `moe.d_ff or model.d_ff` as
    `d_ff`), its `shared_d_ff` 0 is `d_ff`."""

    # The experts' matmuls; `tfjax.nn.quant` sets quantized ones on the instance.
    expert_einsum = staticmethod(jnp.einsum)
    expert_ragged_dot = staticmethod(jax.lax.ragged_dot)

    def __init__(self, d_model: int, d_ff: int, moe: MoEConfig, *, activation: str = "swiglu",
                 use_bias: bool = False, dtype: DType = jnp.float32,
                 param_dtype: DType = jnp.float32, init_std: float = 0.02,
                 out_init_std: float | None = None, rngs: nnx.Rngs):
        m = moe
        num_experts, experts_per_token, capacity_factor = (m.num_experts, m.experts_per_token,
                                                           m.capacity_factor)
        implementation, score, glu, n_group, topk_group = (m.impl, m.score, m.glu, m.n_group,
                                                           m.topk_group)
        _, gated = ACTIVATIONS.get(activation, field="activation")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if not 1 <= experts_per_token <= num_experts:
            raise ValueError(f"experts_per_token must be in [1, num_experts={num_experts}], got "
                             f"{experts_per_token}")
        if capacity_factor < 0:
            raise ValueError(f"capacity_factor must be >= 0 (0 = dropless), got {capacity_factor}")
        if implementation not in MOE_IMPLEMENTATIONS:
            raise ValueError(f"impl={implementation!r}; allowed: "
                             f"{', '.join(MOE_IMPLEMENTATIONS)}")
        if score not in MOE_SCORES:
            raise ValueError(f"score={score!r}; allowed: {', '.join(MOE_SCORES)}")
        if glu not in MOE_GLUS:
            raise ValueError(f"glu={glu!r}; allowed: {', '.join(MOE_GLUS)}")
        if glu == "clamped" and activation != "swiglu":
            raise ValueError(f"glu='clamped' is gpt-oss's SwiGLU: needs activation='swiglu', "
                             f"got {activation!r}")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group must divide num_experts={num_experts}, got {n_group}")
        if n_group > 1 and num_experts // n_group < 2:
            raise ValueError(f"n_group={n_group}: a group scores its top-2 experts, so needs "
                             f">= 2 experts per group (num_experts={num_experts})")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
        if experts_per_token > topk_group * (num_experts // n_group):
            raise ValueError(f"experts_per_token={experts_per_token} exceeds the experts of the "
                             f"topk_group={topk_group} kept groups "
                             f"({topk_group * (num_experts // n_group)})")
        if m.bias_update_rate < 0:
            raise ValueError(f"bias_update_rate must be >= 0 (0 = off), got {m.bias_update_rate}")
        if m.gate_input and capacity_factor > 0:
            raise ValueError("gate_input=True (Llama 4) needs dropless dispatch: set "
                             "capacity_factor=0")
        if m.shared_gate and not m.shared_experts:
            raise ValueError("shared_gate=True gates the shared expert: set shared_experts >= 1")
        E, D, F = num_experts, d_model, d_ff
        self.num_experts, self.k = E, experts_per_token
        self.score, self.n_group, self.topk_group = score, int(n_group), int(topk_group)
        self.routed_scaling_factor = float(m.routed_scaling_factor)
        self.glu, self.glu_alpha, self.glu_limit = glu, float(m.glu_alpha), float(m.glu_limit)
        self.gate_input = bool(m.gate_input)
        self.activation, self.gated, self.use_bias = activation, gated, use_bias
        self.renormalize, self.capacity_factor = m.router_renormalize, float(capacity_factor)
        self.implementation = implementation
        self.aux_loss_weight = float(m.aux_loss_weight)
        self.z_loss_weight = float(m.z_loss_weight)
        self.dtype = dtype
        out_std = init_std if out_init_std is None else out_init_std

        def param(shape, names, std):
            init = nnx.initializers.normal(std) if std else nnx.initializers.zeros_init()
            return nnx.Param(with_logical_axes(init, names)(rngs.params(), shape, param_dtype))

        self.router = param((D, E), ("embed", None), init_std)
        self.router_bias = param((E,), (None,), 0.0) if m.router_bias else None
        self.score_bias = (MoEBias(jnp.zeros((E,), jnp.float32),
                                   update_rate=float(m.bias_update_rate))
                           if m.score_bias or m.bias_update_rate > 0 else None)
        if gated:
            self.wi_gate = param((E, D, F), ("expert", "embed", "mlp"), init_std)
            self.wi_up = param((E, D, F), ("expert", "embed", "mlp"), init_std)
        else:
            self.wi = param((E, D, F), ("expert", "embed", "mlp"), init_std)
        self.wo = param((E, F, D), ("expert", "mlp", "embed"), out_std)
        if use_bias:
            names = ("expert", "mlp")
            if gated:
                self.bi_gate = param((E, F), names, 0.0)
                self.bi_up = param((E, F), names, 0.0)
            else:
                self.bi = param((E, F), names, 0.0)
            self.bo = param((E, D), ("expert", "embed"), 0.0)
        self.shared = (FeedForward(D, m.shared_experts * (m.shared_d_ff or F),
                                   activation=activation, use_bias=use_bias, dtype=dtype,
                                   param_dtype=param_dtype, init_std=init_std,
                                   out_init_std=out_init_std, rngs=rngs)
                       if m.shared_experts else None)
        self.shared_gate = param((D, 1), ("embed", None), init_std) if m.shared_gate else None
        f32 = jnp.float32
        self.load_balance_loss = MoEAux(jnp.zeros((), f32))
        self.router_z_loss = MoEAux(jnp.zeros((), f32))
        self.dropped_fraction = MoEAux(jnp.zeros((), f32))
        self.expert_load = MoEAux(jnp.zeros((E,), f32))

    # -- experts ----------------------------------------------------------------
    def _w(self, name):
        return getattr(self, name)[...].astype(self.dtype)

    def _expert_hidden(self, h_gate, h_up=None):
        if self.glu == "clamped":  # gpt-oss
            g = jnp.minimum(h_gate, self.glu_limit)
            u = jnp.clip(h_up, -self.glu_limit, self.glu_limit)
            return (u + 1) * g * jax.nn.sigmoid(self.glu_alpha * g)
        act, _ = ACTIVATIONS.get(self.activation)
        return act(h_gate) * h_up if self.gated else act(h_gate)

    def _experts_dense(self, x):
        """Every expert on every token: x `[M, D]` -> `[M, E, D]` (the reference)."""
        first = "wi_gate" if self.gated else "wi"
        h_gate = self.expert_einsum("MD,EDF->MEF", x, self._w(first))
        h_up = self.expert_einsum("MD,EDF->MEF", x, self._w("wi_up")) if self.gated else None
        if self.use_bias:
            h_gate = h_gate + self._w("bi_gate" if self.gated else "bi")
            h_up = h_up + self._w("bi_up") if self.gated else None
        y = self.expert_einsum("MEF,EFD->MED", self._expert_hidden(h_gate, h_up), self._w("wo"))
        return y + self._w("bo") if self.use_bias else y

    def _experts_ragged(self, xs, expert_ids, group_sizes):
        """xs `[A, D]` sorted by expert (`group_sizes [E]`) -> `[A, D]` (grouped matmul)."""
        first = "wi_gate" if self.gated else "wi"
        h_gate = self.expert_ragged_dot(xs, self._w(first), group_sizes)
        h_up = self.expert_ragged_dot(xs, self._w("wi_up"), group_sizes) if self.gated else None
        if self.use_bias:
            h_gate = h_gate + self._w("bi_gate" if self.gated else "bi")[expert_ids]
            h_up = h_up + self._w("bi_up")[expert_ids] if self.gated else None
        y = self.expert_ragged_dot(self._expert_hidden(h_gate, h_up), self._w("wo"), group_sizes)
        return y + self._w("bo")[expert_ids] if self.use_bias else y

    def _experts_buffer(self, xb):
        """Capacity buffer xb `[E, B, C, D]` -> `[E, B, C, D]` (expert-parallel layout)."""
        xb = shard(xb, ("expert", "batch", None, "embed"))
        first = "wi_gate" if self.gated else "wi"
        h_gate = self.expert_einsum("EBCD,EDF->EBCF", xb, self._w(first))
        h_up = self.expert_einsum("EBCD,EDF->EBCF", xb, self._w("wi_up")) if self.gated else None
        if self.use_bias:
            h_gate = h_gate + self._w("bi_gate" if self.gated else "bi")[:, None, None]
            h_up = h_up + self._w("bi_up")[:, None, None] if self.gated else None
        h = shard(self._expert_hidden(h_gate, h_up), ("expert", "batch", None, "mlp"))
        y = self.expert_einsum("EBCF,EFD->EBCD", h, self._w("wo"))
        if self.use_bias:
            y = y + self._w("bo")[:, None, None]
        return shard(y, ("expert", "batch", None, "embed"))

    def capacity(self, T: int) -> int:
        """Slots per expert per sequence of T tokens (capacity_factor > 0)."""
        c = math.ceil(self.capacity_factor * T * self.k / self.num_experts)
        return max(1, min(c, T))

    # -- forward ------------------------------------------------------------------
    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        B, T, _ = x.shape
        E, k = self.num_experts, self.k
        x = x.astype(self.dtype)
        logits = jnp.einsum("BTD,DE->BTE", x.astype(jnp.float32),
                            self.router[...].astype(jnp.float32))
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        logits = hook("hook_router_logits", logits)  # [B,T,E] (tfjax.nn.hooks)
        scores, gates, experts = route(  # [B,T,E], [B,T,k], [B,T,k]
            logits, k, self.renormalize, score=self.score,
            bias=None if self.score_bias is None else self.score_bias[...],
            n_group=self.n_group, topk_group=self.topk_group, scale=self.routed_scaling_factor)
        gates, experts = hook("hook_expert_weights", gates), hook("hook_expert_indices", experts)
        probs = scores if self.score == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)

        counts = jnp.sum(jax.nn.one_hot(experts, E, dtype=jnp.float32), axis=(0, 1, 2))  # [E]
        load = counts / (B * T * k)
        self.load_balance_loss[...] = E * jnp.sum(load * jnp.mean(probs, axis=(0, 1)))
        self.router_z_loss[...] = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        self.expert_load[...] = load

        if self.capacity_factor > 0:
            y, dropped = self._capacity_forward(x, gates, experts)
            self.dropped_fraction[...] = dropped
        else:
            y = self._dropless_forward(x, gates, experts)
            self.dropped_fraction[...] = jnp.zeros((), jnp.float32)
        if self.shared is not None:
            with scope("shared_expert"):
                s = self.shared(x)
            if self.shared_gate is not None:
                s = s * jax.nn.sigmoid(jnp.einsum("BTD,DO->BTO", x, self._w("shared_gate")))
            y = y + s
        return shard(y.astype(self.dtype), ("batch", "length", "embed"))

    def _dropless_forward(self, x, gates, experts):
        B, T, D = x.shape
        M, k, E = B * T, self.k, self.num_experts
        xf = x.reshape(M, D)
        g = gates.reshape(M, k).astype(self.dtype)
        if self.implementation == "dense":
            if self.gate_input:  # Llama 4: each assignment's own scaled input
                ye = self._experts_dense((xf[:, None] * g[..., None]).reshape(M * k, D))
                ye = ye.reshape(M, k, E, D)
                picked = jnp.take_along_axis(ye, experts.reshape(M, k)[..., None, None], axis=2)
                return jnp.sum(picked[:, :, 0], axis=1).reshape(B, T, D)
            ye = self._experts_dense(xf)  # [M, E, D]
            picked = jnp.take_along_axis(ye, experts.reshape(M, k)[..., None], axis=1)  # [M,k,D]
            return jnp.einsum("MKD,MK->MD", picked, g).reshape(B, T, D)
        ids = experts.reshape(M * k)
        order = jnp.argsort(ids, stable=True)  # assignments grouped by expert
        token = order // k
        group_sizes = jnp.bincount(ids, length=E).astype(jnp.int32)
        xs = xf[token]
        if self.gate_input:
            xs = xs * g.reshape(M * k)[order][:, None]
        ys = self._experts_ragged(xs, ids[order], group_sizes)  # [A, D]
        y = jnp.zeros_like(ys).at[order].set(ys).reshape(M, k, D)
        if self.gate_input:
            return jnp.sum(y, axis=1).reshape(B, T, D)
        return jnp.einsum("MKD,MK->MD", y, g).reshape(B, T, D)

    def _capacity_forward(self, x, gates, experts):
        B, T, D = x.shape
        E, k, C = self.num_experts, self.k, self.capacity(T)
        slot, keep = capacity_slots(experts, E, C)  # [B, T, k]
        flat = jnp.where(keep, experts * C + slot, E * C)  # E*C = the "dropped" bin
        # Which token fills each slot (T = an all-zero padding row for empty slots).
        token = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :, None], (B, T, k))
        slot_token = jnp.full((B, E * C + 1), T, jnp.int32)
        slot_token = slot_token.at[jnp.arange(B)[:, None], flat.reshape(B, T * k)].set(
            token.reshape(B, T * k))[:, :E * C]  # [B, E*C]
        xp = jnp.concatenate([x, jnp.zeros((B, 1, D), x.dtype)], axis=1)  # [B, T+1, D]
        xb = jnp.take_along_axis(xp, slot_token[..., None], axis=1)  # [B, E*C, D]
        xb = xb.reshape(B, E, C, D).swapaxes(0, 1)  # [E, B, C, D]
        yb = self._experts_buffer(xb).swapaxes(0, 1).reshape(B, E * C, D)
        yb = jnp.concatenate([yb, jnp.zeros((B, 1, D), yb.dtype)], axis=1)  # dropped -> 0
        picked = jnp.take_along_axis(yb, flat.reshape(B, T * k)[..., None], axis=1)
        picked = picked.reshape(B, T, k, D)
        y = jnp.einsum("BTKD,BTK->BTD", picked, (gates * keep).astype(self.dtype))
        return y, jnp.mean((~keep).astype(jnp.float32))


def moe_aux(model: nnx.Module) -> dict[str, jax.Array]:
    """MoE losses and metrics of the last forward pass of `model` (any module tree).

    Returns float32 values (zeros when the model has no MoE layer):
      aux_loss           sum over MoE layers of aux_loss_weight * load_balance
                         + z_loss_weight * router_z: add it to the training loss
      load_balance_loss  mean over MoE layers (1.0 = perfectly balanced)
      router_z_loss      mean over MoE layers
      dropped_fraction   mean over MoE layers of the share of dropped assignments
      expert_load        `[E]` mean over MoE layers of each expert's share of assignments
                         (absent when the model has no MoE layer)
    Call it on the same module object right after the forward pass, inside the traced
    loss function, so the loss is differentiable.
    """
    f32 = jnp.float32
    total = lb = z = dropped = jnp.zeros((), f32)
    load, n = None, 0
    for _, m in nnx.iter_graph(model):
        if not isinstance(m, MoE):
            continue
        lb_m = m.load_balance_loss[...].astype(f32)  # [] or [L] when scanned over layers
        z_m = m.router_z_loss[...].astype(f32)
        total = total + jnp.sum(m.aux_loss_weight * lb_m + m.z_loss_weight * z_m)
        lb, z = lb + jnp.sum(lb_m), z + jnp.sum(z_m)
        dropped = dropped + jnp.sum(m.dropped_fraction[...].astype(f32))
        el = m.expert_load[...].astype(f32).reshape(-1, m.num_experts)
        load = jnp.sum(el, 0) if load is None else load + jnp.sum(el, 0)
        n += lb_m.size
    out = dict(aux_loss=total)
    if n:
        out.update(load_balance_loss=lb / n, router_z_loss=z / n, dropped_fraction=dropped / n,
                   expert_load=load / n)
    else:
        out.update(load_balance_loss=lb, router_z_loss=z, dropped_fraction=dropped)
    return out
