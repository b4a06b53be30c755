"""The oracle of `Step5SparseIndexer`'s projections: plain PyTorch from the indexer's weights
(SEMANTICS §1.2), without the fused kernels (`sa_kernels.rms_norm_rope_e4m3`, the in-place RoPE).

The oracles of the routing ops live beside them: `metadata/reference.py`, `summaries/reference.py`,
`selection/reference.py`, `tile_rows/reference.py`.
"""

import torch

from ..summaries.reference import round_e4m3


def reference_rope(
    x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float
) -> torch.Tensor:
    """NeoX half-split RoPE over the first `rope_dim` dims of x [B, S, ..., D] in FP32, back to x's dtype."""
    half = rope_dim // 2
    inv_freq = 1.0 / theta ** (
        torch.arange(0, rope_dim, 2, dtype=torch.float32, device=x.device) / rope_dim
    )
    angle = positions.float()[..., None] * inv_freq
    angle = angle.reshape(*positions.shape, *([1] * (x.dim() - 3)), half)
    a, b = x[..., :half].float(), x[..., half:rope_dim].float()
    out = x.clone()
    out[..., :half] = (a * angle.cos() - b * angle.sin()).to(x.dtype)
    out[..., half:rope_dim] = (b * angle.cos() + a * angle.sin()).to(x.dtype)
    return out


def reference_project_keys(
    indexer: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (LayerNorm `E[x²] − E[x]²`, weights in x's dtype, then RoPE) and logits, from the indexer's weights."""
    cfg = indexer.config
    with torch.no_grad():
        k = hidden @ indexer.k_proj.weight.t()
        kf = k.float()
        mean = kf.mean(-1, keepdim=True)
        var = (kf * kf).mean(-1, keepdim=True) - mean * mean
        w = indexer.k_norm.weight.to(k.dtype).float()
        bias = indexer.k_norm.bias.to(k.dtype).float()
        normed = ((kf - mean) / torch.sqrt(var + cfg.norm_eps) * w + bias).to(k.dtype)
        keys = reference_rope(normed, positions, cfg.rope_dim, indexer.rotary.theta)
        return keys, hidden @ indexer.z_proj.weight.t()


def reference_project_queries(
    indexer: torch.nn.Module, hidden: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3-rounded queries [B, S, G, H, D] and FP32 weights [B, S, G, H], from the indexer's weights."""
    cfg = indexer.config
    groups, heads = cfg.num_provider_groups, cfg.heads_per_group
    with torch.no_grad():
        q = (hidden @ indexer.q_proj.weight.t()).view(
            *hidden.shape[:2], groups, heads, cfg.proxy_dim
        )
        qf = q.float()
        scale = 1.0 + indexer.q_norm.weight.to(q.dtype).float()
        normed = (qf * torch.rsqrt((qf * qf).mean(-1, keepdim=True) + cfg.norm_eps) * scale).to(
            q.dtype
        )
        query = round_e4m3(reference_rope(normed, positions, cfg.rope_dim, indexer.rotary.theta))
        w = (hidden @ indexer.w_proj.weight.to(hidden.dtype).t()).float() * heads**-0.5
        return query, w.view(*hidden.shape[:2], groups, heads)
