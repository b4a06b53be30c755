"""A short tour of sa on CPU: routing, sparse attention over routes, replay and context parallelism.

uv run python tools/tour.py
"""

import torch
from torch.utils.checkpoint import checkpoint

from sa_cp import ContextParallelLayout, checkpoint_context_fn, shard_sequence
from sa_cp.testing import TOY_ROUTES, ToyRoutedLayer
from sa_kernels import sparse_gqa_attention
from sa_mla import sparse_mla_attention
from sa_routing import (
    QSAIndexer,
    QSAIndexerConfig,
    Step5SparseConfig,
    Step5SparseIndexer,
    region_metadata,
    rotary_table,
)


def qsa_tour() -> None:
    print("== QSA: compressed-block routes, then sparse GQA attention over them ==")
    config = QSAIndexerConfig(
        hidden_size=40,
        indexer_n_heads=3,
        indexer_head_dim=16,
        indexer_budget=12,  # tokens, in blocks of indexer_compress_ratio
        indexer_compress_ratio=3,
    )
    torch.manual_seed(0)
    indexer = QSAIndexer(config)
    indexer.init_weights(init_std=0.2)
    tokens = 48
    hidden = torch.randn(1, tokens, 40)
    ids = indexer(hidden, rotary_table(torch.arange(tokens), 16)[None])
    for row in (5, 20, 47):
        valid = ids[0, row][ids[0, row] >= 0].tolist()
        print(f"query {row:>2} attends to {len(valid):>2} of {row + 1:>2} tokens: {valid}")
    query, key, value = (
        torch.randn(1, tokens, 4, 8),
        torch.randn(1, tokens, 2, 8),
        torch.randn(1, tokens, 2, 8),
    )
    out = sparse_gqa_attention(query, key, value, ids)
    print(f"sparse_gqa_attention: query {tuple(query.shape)}, 2 KV heads -> {tuple(out.shape)}")


def step5_tour() -> None:
    print("\n== Step-5 CSA: regions per document, top-k historical regions + the current one ==")
    config = Step5SparseConfig(
        hidden_size=64,
        proxy_dim=32,
        index_heads=4,
        num_provider_groups=2,
        rope_dim=8,
        region_size=4,
        topk=2,
    )
    indexer = Step5SparseIndexer(config, layer_idx=3, dtype=torch.bfloat16)
    for parameter in indexer.parameters():
        parameter.data.normal_(0, 0.3)
    positions = torch.cat([torch.arange(20), torch.arange(12)])[
        None
    ]  # two documents: 20 and 12 tokens
    hidden = torch.randn(1, 32, 64, dtype=torch.bfloat16)
    metadata = region_metadata(positions, None, 0, 32, config.region_size, config.topk)
    keys, logits = indexer.project_keys(hidden, positions)
    selection = indexer(hidden, positions, keys, logits, positions, None, metadata=metadata)
    for query in (3, 19, 31):
        regions = [
            r for r in selection.region_ids[0, 0, query].tolist() if r < selection.region_count
        ]
        print(f"query {query:>2} (document position {positions[0, query]:>2}) -> regions {regions}")


def mla_tour() -> None:
    print("\n== Sparse MLA: one latent K/V head, per-query top-k ids (oracle on CPU) ==")
    q = torch.randn(6, 4, 576, dtype=torch.bfloat16)
    kv = torch.randn(32, 1, 576, dtype=torch.bfloat16)
    ids = torch.randint(-1, 32, (6, 1, 8), dtype=torch.int32)
    out = sparse_mla_attention(q, kv, ids, 576**-0.5)
    print(
        f"sparse_mla_attention(backend='auto' -> reference on CPU): {tuple(out.shape)} {out.dtype}"
    )


def context_parallel_tour() -> None:
    print("\n== sa-cp: contiguous context-parallel shards ==")
    positions = torch.arange(100)[None]
    for rank in range(3):
        layout = ContextParallelLayout.create(100, multiple_of=8, pad=True, rank=rank, size=3)
        shard = shard_sequence(positions, layout, pad_value=-1)
        print(
            f"rank {rank}: positions [{layout.local_start}, {layout.local_stop}) -> first {shard[0, :3].tolist()} last {shard[0, -3:].tolist()}"
        )


def replay_tour() -> None:
    print("\n== sa-cp: recompute replay ==")
    x = torch.randn(2, 64, 16, requires_grad=True)
    for label, context_fn in (
        ("checkpoint", None),
        ("checkpoint + replay", checkpoint_context_fn(None, TOY_ROUTES)),
    ):
        layer = ToyRoutedLayer(16, 8)
        kwargs = {"context_fn": context_fn} if context_fn else {}
        checkpoint(layer, x, use_reentrant=False, **kwargs).sum().backward()
        print(f"{label:<22} router ran {layer.router_calls}x per step")


if __name__ == "__main__":
    torch.manual_seed(0)
    qsa_tour()
    step5_tour()
    mla_tour()
    context_parallel_tour()
    replay_tour()
