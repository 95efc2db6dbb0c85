"""The model's forward on a CPU as a flat run of kernel calls.

A decode step of a small model spends a good part of its forward in Python
between the kernels: per layer, nine ``nn.Module`` calls, each through the
hooks machinery of ``Module.__call__``, and the checks each wrapper makes
before it reaches its C++ kernel. On a GPU, CUDA graphs remove that cost
(:mod:`.cuda_graphs`). On a CPU, :class:`FlatForward` removes it: it looks
up, once, each layer's norm weights, packed linear products (:mod:`.prepack`)
and KV slots, then runs a step's decoder layers as one call of a C++ loop over
the same kernels (``attention/csrc/decoder_layers.cpp``); only the embedding,
the rotary table and the final norm and ``lm_head`` stay in Python. Where the
attention backend's ``forward`` is wrapped (the profiling harness times it),
the loop runs in Python instead, calling the kernels directly and that
``forward`` once a layer (as it does with ``use_cpp = False``, which the
appendix uses to measure the difference). Either way it computes what the
model's own forward computes, with the same kernels in the same order, so the
logits are bit-identical (``tests/engine/test_flat_forward.py``). The CPU appendix
measures what it saves a step ("Python between the kernels").

It applies where every piece has its kernel: a llama-family
:class:`~minibatch_engine.model.transformer.Transformer` without per-head q/k
norms, float32 on the CPU, the C++ kernels built and not switched off
(:func:`~minibatch_engine.model.fused.torch_ops_only`), the ``"cpp"``
attention backend over an unquantized cache, no hooks on the model's modules,
and every projection packed (:mod:`.prepack`) for the step's row count, its
packed copy current. Any other step runs the model's own forward.
"""
from __future__ import annotations

import torch

from ..attention.cpp_backend import CppBackend
from ..attention.cpu_kernel import cpu_kernel_or_none
from ..kv.quant import is_quantized
from ..model import fused
from . import prepack


def _has_hooks(model: torch.nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class FlatForward:
    """Runs ``model``'s forward over ``kv_pool`` as a flat loop of kernel calls
    where :meth:`can_run` says so."""

    def __init__(self, model, kv_pool):
        self.model, self.kv_pool = model, kv_pool
        cfg = model.config
        self.kernel = cpu_kernel_or_none()
        self.supported = (self.kernel is not None and cfg.family == "llama" and not cfg.qk_norm
                          and model.device.type == "cpu" and model.dtype == torch.float32
                          and kv_pool is not None and not is_quantized(kv_pool.layer(0)[0]))
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.split_qkv, self.split_qk, self.kv_shape = [(H + Hkv) * D, Hkv * D], [H, Hkv], (Hkv, D)
        self.qk_shape, self.eps = (H + Hkv, D), cfg.norm_eps
        self.layers: list | None = None     # resolved lazily: packing happens at the first forward
        self.watch: list = []               # (layer, weight, version) of every projection
        self.from_rows = 0
        self.steps = 0                      # steps run flat so far
        self.cpp_steps = 0                  # of which the decoder layers ran as one C++ call
        self.use_cpp = True                 # False: the Python loop always (to measure the difference)
        # decoder_layers's arguments: 12 tensors a layer and the products' out_features
        # (None where some product is not a panel product)
        self.weights: list | None = None
        self.out_features: list[int] = []

    def _projections(self, block):
        return block.attn.qkv_proj, block.attn.o_proj, block.mlp.gate_up_proj, block.mlp.down_proj

    def _resolve(self) -> bool:
        """Look up each layer's pieces; False where some projection is not packed yet."""
        model, watch, layers = self.model, [], []
        if _has_hooks(model):
            return False
        for i, block in enumerate(model.layers):
            products = []
            for lin in self._projections(block):
                packed = prepack.packed_product(lin)
                if packed is None:
                    return False
                products.append((packed, lin.bias))
                watch.append((lin, lin.weight, lin.weight._version))
            layers.append((block.attn_norm.weight, block.mlp_norm.weight, *products, *self.kv_pool.layer(i)))
        self.layers, self.watch = layers, watch
        self.weights, self.out_features = None, []
        if all(isinstance(p, prepack.PanelProduct) for layer in layers for p, _ in layer[2:6]):
            self.out_features = [p.out_features for p, _ in layers[0][2:6]]
            self.weights = [t for a, b, *products, ks, vs in layers
                            for t in (a, b, *(x for p, bias in products
                                              for x in (p.panels, prepack.NO_BIAS if bias is None else bias)), ks, vs)]
        self.from_rows = max(lin.packed_from_rows for lin, _, _ in watch)
        return True

    def _current(self) -> bool:
        return all(lin.weight is w and w._version == v and "forward" in lin.__dict__ for lin, w, v in self.watch)

    def can_run(self, num_tokens: int, meta) -> bool:
        """Whether this step (``num_tokens`` rows, attention metadata ``meta``)
        can run flat: everything the module doc lists holds now."""
        if not (self.supported and fused._enabled and isinstance(meta.backend, CppBackend)
                and meta.slot_mapping is not None and not torch.is_grad_enabled()):
            return False
        if self.layers is None or not self._current():
            self.layers = None
            first = self.model.layers[0].attn.qkv_proj
            if "forward" not in first.__dict__ or not self._resolve():   # cheap look first: plain weights
                return False
        return num_tokens >= self.from_rows

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The logits ``model(input_ids, positions, meta, kv_pool)`` returns."""
        model, k = self.model, self.kernel
        self.steps += 1
        x = model.embed(input_ids)
        cos, sin = model._rope(positions, x.dtype)
        backend = meta.backend
        if self.use_cpp and self.weights is not None and "forward" not in vars(backend):   # not wrapped: C++
            self.cpp_steps += 1
            x = k.decoder_layers(x, cos, sin, self.weights, self.out_features, self.split_qk[0], self.split_qk[1],
                                 self.eps, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, meta.block_size, backend.simd)
            return model.lm_head(model.norm(x[meta.logits_indices]))
        T, eps, forward = x.shape[0], self.eps, backend.forward
        for attn_norm, mlp_norm, (qkv, qkv_b), (o, o_b), (gate_up, gu_b), (down, down_b), k_slots, v_slots \
                in self.layers:
            qk, v = qkv(k.rms_norm(x, attn_norm, eps), qkv_b).split(self.split_qkv, dim=-1)
            q, key = k.rope(qk.view(T, *self.qk_shape), cos, sin).split(self.split_qk, dim=1)
            out = forward(q, key, v.view(T, *self.kv_shape), meta, k_slots, v_slots)
            x = x + o(out.view(T, -1), o_b)
            x = x + down(k.silu_and_mul(gate_up(k.rms_norm(x, mlp_norm, eps), gu_b)), down_b)
        return model.lm_head(model.norm(x[meta.logits_indices]))
