"""What the CP parity tool (tools/cp_parity.py) and the CP scaling benchmark (bench_cp_scaling.py)
share: the process group of a torchrun launch (or a one-rank group without one), the 4-layer Step-5
and QSA models at each size, one-row global batches (plain or packed) and one model call on a
contiguous sequence shard.

Sizes:
    tiny   CPU checks: `sa_layers.testing`'s tiny models with 4 layers, 4 heads and vocab 64
           (hidden 32, 2 KV groups, head_dim 16; Step-5 window 8, region 4, top-2; QSA budget 8,
           compress ratio 2; FP32, the "reference" attention backend).
    small  GPU parity: hidden 1024, 16 heads / 2 KV groups, head_dim 128; Step-5 window 512,
           region 8, top-64; QSA indexer 4 × 64, budget 1024, ratio 4; vocab 8192.
    bench  the geometries of bench_step5_layer.py's and bench_qsa_layer.py's model rows (Step-5
           hidden 2048 with `Step5Config`'s attention and indexer defaults; QSA `QSAConfig`'s
           defaults), both with vocab 4096 so that the LM head, which scales perfectly, does not
           dominate.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from sa_layers import CausalLMOutput, QSAConfig, QSAModel, Step5Config, Step5Model
from sa_layers.testing import randomise_norms, tiny_qsa_config, tiny_step5_config
from sa_routing import QSAContextParallel, Step5SparseConfig

KINDS = ("step5", "qsa")
SIZES = ("tiny", "small", "bench")
LABELS = {"step5": "4-layer Step5Model (SWA, SWA, SWA, CSA)", "qsa": "4-layer QSAModel"}
STEP5_LAYERS = ("swa", "swa", "swa", "csa")


# -- the process group -------------------------------------------------------------------------------


def init_distributed(backend: str, device_type: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*), or
    make a one-rank group when the script runs without torchrun. Returns (rank, world size, this
    rank's device: `cuda:LOCAL_RANK` or the CPU)."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"init_distributed: backend must be 'nccl' or 'gloo'; got {backend!r}")
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"init_distributed: device must be 'cuda' or 'cpu'; got {device_type!r}")
    if backend == "nccl" and device_type != "cuda":
        raise ValueError("init_distributed: the nccl backend needs --device cuda")
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("init_distributed: --device cuda but no CUDA device is visible")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device


def all_ranks_max(
    values: list[float], device: torch.device, group: dist.ProcessGroup | None = None
) -> list[float]:
    """Elementwise maximum of `values` over the ranks of `group` (default: all; one all-reduce)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


# -- the models --------------------------------------------------------------------------------------


def step5_config(size: str) -> Step5Config:
    if size == "tiny":
        # the tests' tiny Step-5 model with 4 heads and vocab 64
        return tiny_step5_config(vocab_size=64, num_attention_heads=4, layer_types=STEP5_LAYERS)
    if size == "small":
        return Step5Config(
            vocab_size=8192,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_attention_groups=2,
            head_dim=128,
            sliding_window=512,
            layer_types=STEP5_LAYERS,
            partial_rotary_factor=0.5,
            sparse_config=Step5SparseConfig(
                proxy_dim=128,
                index_heads=8,
                num_provider_groups=2,
                rope_dim=32,
                region_size=8,
                topk=64,
                hidden_size=1024,
            ),
        )
    return Step5Config(
        vocab_size=4096,
        hidden_size=2048,
        intermediate_size=2048 * 11 // 4,
        num_hidden_layers=4,
        layer_types=STEP5_LAYERS,
        sparse_config=Step5SparseConfig(hidden_size=2048),
    )


def qsa_config(size: str) -> QSAConfig:
    if size == "tiny":
        # the tests' tiny QSA model with 4 layers and vocab 64
        return tiny_qsa_config(vocab_size=64, num_hidden_layers=4)
    if size == "small":
        return QSAConfig(
            vocab_size=8192,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=128,
            partial_rotary_factor=0.25,
            indexer_n_heads=4,
            indexer_head_dim=64,
            indexer_budget=1024,
            indexer_compress_ratio=4,
        )
    return QSAConfig(vocab_size=4096, num_hidden_layers=4)


def config(kind: str, size: str) -> Step5Config | QSAConfig:
    if kind not in KINDS or size not in SIZES:
        raise ValueError(
            f"config: kind must be in {KINDS} and size in {SIZES}; got {kind!r}, {size!r}"
        )
    return step5_config(size) if kind == "step5" else qsa_config(size)


def shard_multiple(kind: str, size: str) -> int:
    """Tokens per shard must be a multiple of this (Step-5: the region size; QSA: the compress
    ratio)."""
    cfg = config(kind, size)
    return cfg.sparse_config.region_size if kind == "step5" else cfg.indexer_compress_ratio


def geometry(kind: str, size: str) -> str:
    """The model's sizes in a few words (for tables and benchmark rows)."""
    cfg = config(kind, size)
    if kind == "step5":
        s = cfg.sparse_config
        return (
            f"hidden {cfg.hidden_size}, Hq {cfg.num_attention_heads} / G {cfg.num_attention_groups}, "
            f"D {cfg.head_dim}, window {cfg.sliding_window}, region {s.region_size}, top-k {s.topk}, "
            f"vocab {cfg.vocab_size}"
        )
    return (
        f"hidden {cfg.hidden_size}, Hq {cfg.num_attention_heads} / Hkv {cfg.num_key_value_heads}, "
        f"D {cfg.head_dim}, budget {cfg.indexer_budget}, ratio {cfg.indexer_compress_ratio}, "
        f"vocab {cfg.vocab_size}"
    )


def build(
    kind: str, size: str, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> nn.Module:
    """The model of `kind` at `size`, the same on every rank: built in FP32 on the CPU from `seed`,
    its norm scales drawn at random (a wrong norm cannot hide behind identity scales), then moved to
    `device` and cast to `dtype` (the norms and indexer weights that stay FP32 stay FP32)."""
    torch.manual_seed(seed)
    cfg = config(kind, size)
    model = Step5Model(cfg) if kind == "step5" else QSAModel(cfg)
    randomise_norms(model)
    return model.to(device=device, dtype=dtype)


# -- batches and one model call ----------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One global row of a model call.

    Attributes:
        input_ids, labels: int64 [1, tokens] (labels aligned to their positions).
        positions: Step-5 packed rows: int64 [1, tokens] document-local positions (a 0 starts a
            document), or None (one document).
        padding: Step-5 packed rows: bool [1, tokens], True on the padding tail, or None.
        cu_seqlens: QSA packed rows: the document boundaries `(0, ..., tokens)`, or None.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    padding: torch.Tensor | None = None
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


def document_bounds(tokens: int, generator: torch.Generator, documents: int = 5) -> list[int]:
    """`(0, b_1, ..., tokens)`: `documents` back-to-back documents of random lengths, each at least
    `tokens // (4 · documents)` long, so that boundaries fall inside shards and across them."""
    least = max(1, tokens // (4 * documents))
    spare = tokens - least * documents
    cuts = torch.rand(documents - 1, generator=generator).sort().values
    bounds = [0, *(int(c * spare) + least * (i + 1) for i, c in enumerate(cuts.tolist())), tokens]
    return bounds


def make_batch(
    kind: str, size: str, tokens: int, packed: bool, device: torch.device, seed: int = 1
) -> Batch:
    """One row of `tokens` random tokens and labels. Packed: five documents of random lengths
    (Step-5: positions restarting at 0, the last 1/16 of the row padding; QSA: `cu_seqlens`)."""
    vocab = config(kind, size).vocab_size
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, tokens), generator=generator)
    labels = torch.randint(0, vocab, (1, tokens), generator=generator)
    if not packed:
        return Batch(ids.to(device), labels.to(device))
    if kind == "qsa":
        return Batch(
            ids.to(device), labels.to(device), cu_seqlens=tuple(document_bounds(tokens, generator))
        )
    valid = tokens - tokens // 16
    bounds = document_bounds(valid, generator)
    positions = torch.zeros(1, tokens, dtype=torch.int64)
    positions[0, :valid] = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(bounds)])
    padding = torch.zeros(1, tokens, dtype=torch.bool)
    padding[0, valid:] = True
    return Batch(ids.to(device), labels.to(device), positions.to(device), padding.to(device))


def run(
    kind: str,
    model: nn.Module,
    batch: Batch,
    shard: tuple[int, int] = (0, 1),
    group: dist.ProcessGroup | None = None,
) -> CausalLMOutput:
    """`model` on the whole row (`group` None), or on the contiguous shard `shard = (rank, size)`
    of it with `group` the context-parallel process group (of any size, one included)."""
    rank, size = shard
    local = batch.tokens // size
    cols = slice(rank * local, (rank + 1) * local)
    ids, labels = batch.input_ids[:, cols], batch.labels[:, cols]
    if kind == "step5":
        positions = None if batch.positions is None else batch.positions[:, cols]
        padding = None if batch.padding is None else batch.padding[:, cols]
        return model(ids, positions, padding, labels, cp_group=group)
    if group is None:
        return model(ids, cu_seqlens=batch.cu_seqlens, labels=labels)
    cp = QSAContextParallel.create(local, group=group, cu_seqlens=batch.cu_seqlens)
    return model(ids, labels=labels, cp_context=cp)


def objective(out: CausalLMOutput) -> torch.Tensor:
    """The training objective: the LM loss plus the indexers' distillation loss when it is on."""
    return out.loss if out.indexer_loss is None else out.loss + out.indexer_loss


def route_dim(kind: str) -> int:
    """The sequence dimension of an indexer's routes (Step-5 region ids [B, G, L, k]; QSA token ids
    [B, L, W])."""
    return 2 if kind == "step5" else 1


def record_routes(model: nn.Module) -> list[torch.Tensor]:
    """A list every indexer call of `model` appends its routes to (clear it between runs)."""
    seen: list[torch.Tensor] = []

    def record(_module, _inputs, out):
        seen.append((out if isinstance(out, torch.Tensor) else out.region_ids).detach())

    for indexer in model.indexers():
        indexer.register_forward_hook(record)
    return seen
