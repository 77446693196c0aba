"""One head of the fused QKV projection for all rows: matmul (+bias), then for q and k heads the
per-head q/k-norm (Qwen3) and RoPE; q goes to the q buffer, k and v are appended to the paged KV cache
at each row's position. A tile is one head so that norm and RoPE see whole heads."""
import torch

from distmk.tasks.base import TaskKind, rms_norm, rope


class QKV(TaskKind):
    name = "qkv"
    args = ("head_slot",)  # 0..hq-1: query heads, then hkv key heads, then hkv value heads (local)

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(shape.spec.head_dim, shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        (slot,) = a
        spec, plan, lw = ctx.spec, ctx.plan, ctx.weights.layers[layer]
        d, n = spec.head_dim, ctx.num_rows
        rows = slice(slot * d, (slot + 1) * d)
        out = ctx.buf["xn"][:n].float() @ lw.wqkv[rows].float().t()
        if lw.bqkv is not None:
            out = out + lw.bqkv[rows].float()
        out = out.to(ctx.dtype)[:, None, :]                        # [n, 1, D]
        pos = ctx.positions[:n]
        if slot < plan.num_heads + plan.num_kv_heads:               # q or k: norm, then rotate
            is_q = slot < plan.num_heads
            if spec.qk_norm:
                out = rms_norm(out, lw.q_norm if is_q else lw.k_norm, spec.rms_norm_eps)
            out = rope(out, pos, ctx.weights.inv_freq).to(ctx.dtype)
            if is_q:
                ctx.buf["q"][:n, slot] = out[:, 0]
                return
            cache, head = ctx.k_cache, slot - plan.num_heads
        else:
            cache, head = ctx.v_cache, slot - plan.num_heads - plan.num_kv_heads
        blocks = ctx.block_table[torch.arange(n), pos // ctx.block_size]
        cache[layer, blocks, pos % ctx.block_size, head] = out[:, 0]
