"""A decoder layer's inference step on the CPU as a flat run of kernel calls.

The modules of runtime.model read well but cost Python on every call: module dispatch, attribute
lookups, each kernel's argument checks. At batch 1 a decode step of a 30-layer model with tiny
widths (so that arithmetic costs almost nothing) took 4.8 ms, about a third of the default
model's step. CpuLayerPlan keeps what one layer's kernels read (fused panels, norm weights, the
attention backend) in plain attributes, checks once per layer what the kernels need, and runs the
same kernels in the same order as the modules: the same bits, with less Python around them. The
default model's forward at one row, replayed alternately with and without plans: 18.25 -> 16.78
ms (the drafter's: 0.49 -> 0.39 ms).

A layer gets a plan (runtime.cpu_gemm.lay_out_for_cpu) when every product of it runs on panels
(q/k/v and gate/up fused) and the C++ kernels are loaded; otherwise, and whenever autograd is on
or the input is not contiguous float32, the modules run as before. The modules stay the
reference: a change to their arithmetic must be made here too (tests/runtime/test_model.py holds
the plans to the modules' bits on every supported architecture).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from runtime.attention.cpu_backend import CpuAttentionBackend, kernel_rows
from runtime.cpu_gemm import Q4_ROWS, FusedPanels, PrepackedLinear, runs_on_panels
from runtime.cpu_kernels import load_cpu_kernels

if TYPE_CHECKING:
    from runtime.attention import AttentionMetadata
    from runtime.model import DecoderLayer
    from runtime.rope import RotaryEmbedding


class CpuLayerPlan:
    """One DecoderLayer's forward on the C++ kernels (see the module docstring)."""

    def __init__(self, layer: DecoderLayer, qkv: FusedPanels, gate_up: FusedPanels,
                 o_proj: PrepackedLinear, down_proj: PrepackedLinear) -> None:
        attn = layer.self_attn
        norm = layer.input_layernorm
        self.input_norm = None if isinstance(norm, torch.nn.Identity) else (norm.weight, norm.eps)
        self.qk_norm = ((attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps)
                        if attn.qk_norm else None)
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.backend = attn.backend
        self.qkv = (qkv._packed, qkv.bias, qkv.splits, qkv._scales)
        self.o_proj = (o_proj._packed, o_proj.bias, o_proj.out_features, o_proj._scales)
        post = layer.post_attention_layernorm
        self.post_norm = (post.weight, post.eps)
        self.gate_up = (gate_up._packed, gate_up.bias, gate_up.splits, gate_up._scales)
        self.down_proj = (down_proj._packed, down_proj.bias, down_proj.out_features,
                          down_proj._scales)
        # 4-bit panels (runtime.weight_panels.q4_panels) for products of up to Q4_ROWS rows, when
        # all four products have them: the same bits, fewer bytes
        qkv4, o4, gate_up4, down4 = qkv._q4, o_proj._q4, gate_up._q4, down_proj._q4
        self.q4: tuple[tuple[Any, ...], ...] | None = None
        if qkv4 is not None and o4 is not None and gate_up4 is not None and down4 is not None:
            self.q4 = ((*qkv4, qkv.bias, qkv.splits), (*o4, o_proj.bias, o_proj.out_features),
                       (*gate_up4, gate_up.bias, gate_up.splits),
                       (*down4, down_proj.bias, down_proj.out_features))

    @staticmethod
    def build(layer: DecoderLayer) -> CpuLayerPlan | None:
        """The layer's plan, or None where its products do not all run on panels."""
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.o_proj, mlp.down_proj)
        if (not load_cpu_kernels() or attn.qkv is None or mlp.gate_up is None
                or not all(runs_on_panels(p) for p in linears)):
            return None
        norms: list[torch.nn.Module] = [layer.post_attention_layernorm]
        if not isinstance(layer.input_layernorm, torch.nn.Identity):
            norms.append(layer.input_layernorm)
        if attn.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        if any(getattr(n, "weight", None) is None or n.weight.dtype != torch.float32
               for n in norms):
            return None
        o_proj, down_proj = linears
        assert isinstance(o_proj, PrepackedLinear) and isinstance(down_proj, PrepackedLinear)
        return CpuLayerPlan(layer, attn.qkv, mlp.gate_up, o_proj, down_proj)

    @staticmethod
    def applies(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> bool:
        """Whether the kernels can take this call (else the modules run)."""
        return (x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
                and x.device.type == "cpu" and positions.is_contiguous()
                and rope.cos.dtype == torch.float32 and not torch.is_grad_enabled())

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, input_size] float32, contiguous
        residual: torch.Tensor,  # [num_tokens, hidden_size]
        positions: torch.Tensor,  # [num_tokens]
        rope: RotaryEmbedding,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], the residual stream after this layer
        ops = torch.ops.eaglebatch
        n = x.shape[0]
        if self.q4 is not None and n <= Q4_ROWS:
            return self._run(x, residual, positions, rope, kv_cache, md, ops.panel_linear_q4,
                             ops.panel_linear_parts_q4, *self.q4)
        return self._run(x, residual, positions, rope, kv_cache, md, ops.panel_linear,
                         ops.panel_linear_parts, self.qkv, self.o_proj, self.gate_up,
                         self.down_proj)

    def _run(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
             rope: RotaryEmbedding, kv_cache: torch.Tensor, md: AttentionMetadata,
             linear: Any, parts: Any, qkv: tuple[Any, ...], o_proj: tuple[Any, ...],
             gate_up: tuple[Any, ...], down_proj: tuple[Any, ...]) -> torch.Tensor:
        """The layer with `linear` / `parts` (float32 or 4-bit panel products) and the
        arguments of each product after its input."""
        ops = torch.ops.eaglebatch
        n = x.shape[0]
        if self.input_norm is not None:
            x = ops.rms_norm(x, *self.input_norm)
        q, k, v = parts(x, *qkv)
        q = q.view(n, self.heads, self.head_dim)
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        if self.qk_norm is not None:
            q_weight, k_weight, eps = self.qk_norm
            q = ops.rms_norm(q.view(-1, self.head_dim), q_weight, eps).view(q.shape)
            k = ops.rms_norm(k.view(-1, self.head_dim), k_weight, eps).view(k.shape)
        q, k = ops.rope(q, k, rope.cos, rope.sin, positions)
        out = self.backend.forward(q, k, v, kv_cache, md)
        h = residual + linear(out.view(n, -1), *o_proj)
        gate, up = parts(ops.rms_norm(h, *self.post_norm), *gate_up)
        return h + linear(F.silu(gate, inplace=True).mul_(up), *down_proj)


class CpuLayerStack:
    """Decoder layers that all have plans, run over a step in one C++ call
    (runtime/csrc/layer_stack.cpp: the plans' kernels in the plans' order, the same bits).

    A plan still costs Python between its ~12 kernels: at one row that is tens of microseconds a
    layer, paid by 30 layers per target step and 2 per draft step. The stack applies to every
    step the cpu attention backend's kernel takes (float32 caches in its layout, one metadata
    object for all layers); elsewhere (another backend, a bfloat16 cache) `run` returns None
    and the caller runs the layers one by one. Each layer takes the
    products its plan would (4-bit panels at up to Q4_ROWS rows where it has them)."""

    def __init__(self, layers: list[DecoderLayer], plans: list[CpuLayerPlan]) -> None:
        self.names = [layer.self_attn.layer_name for layer in layers]
        self._stack: Any = torch.classes.eaglebatch.LayerStack()
        for plan in plans:
            norm = plan.input_norm
            qk = plan.qk_norm
            backend: CpuAttentionBackend = plan.backend  # type: ignore[assignment]
            tensors: list[Any] = [None if norm is None else norm[0], None if qk is None else qk[0],
                                  None if qk is None else qk[1], plan.post_norm[0]]
            ints = [plan.heads, plan.kv_heads, plan.head_dim, backend.sliding_window or 0]
            q4s: tuple[Any, ...] = plan.q4 or (None,) * 4
            products: tuple[tuple[Any, ...], ...] = (plan.qkv, plan.o_proj, plan.gate_up,
                                                     plan.down_proj)
            for (panels, bias, widths, scales), q4 in zip(products, q4s, strict=True):
                tensors += [panels, bias, scales, *((None, None) if q4 is None else q4[:2])]
                outs: list[int] = [widths] if isinstance(widths, int) else list(widths)
                ints += [len(outs), *outs]
            floats = [1e-6 if norm is None else norm[1], 1e-6 if qk is None else qk[2],
                      plan.post_norm[1], backend.scale]
            self._stack.add_layer(tensors, ints, floats)

    @staticmethod
    def build(layers: list[DecoderLayer]) -> CpuLayerStack | None:
        """The stack of `layers`, or None where one has no plan, one's attention backend is not
        the cpu one, or the kernels lack the stack."""
        plans = [layer.cpu_plan for layer in layers]
        if not layers or any(plan is None for plan in plans):
            return None
        if not all(type(plan.backend) is CpuAttentionBackend for plan in plans):  # type: ignore[union-attr]
            return None
        try:
            return CpuLayerStack(layers, plans)  # type: ignore[arg-type]
        except (RuntimeError, AttributeError):  # kernels built without layer_stack.cpp
            return None

    def run(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
            rope: RotaryEmbedding, kv_caches: Mapping[str, torch.Tensor],
            attn_metadata: Mapping[str, AttentionMetadata], aux_ids: tuple[int, ...] = ()
            ) -> list[torch.Tensor] | None:
        """[last residual stream, the streams entering the layers in aux_ids] of the layers
        over this step, or None where the stack does not apply (see the class docstring)."""
        md = attn_metadata[self.names[0]]
        if (not CpuLayerPlan.applies(x, positions, rope) or not residual.is_contiguous()
                or residual.dtype != torch.float32):
            return None
        caches = [kv_caches[name] for name in self.names]
        # the kernel's cache layout (else the backend takes its torch path), and one metadata
        # object for all layers
        if not all(c.dtype == torch.float32 and c.is_contiguous() for c in caches) or any(
                attn_metadata[name] is not md for name in self.names):
            return None
        rows = kernel_rows(md, x.device)
        return self._stack.forward(x, residual, positions, rope.cos, rope.sin, caches,
                                   md.slot_mapping, rows.query_starts, rows.query_lens,
                                   rows.seq_lens, md.block_table,
                                   list(aux_ids), Q4_ROWS)
