"""Context-parallel parity of the 4-layer Step-5 and QSA models against one unsharded process.

Every rank builds the same models from one seed (Step-5: SWA, SWA, SWA, CSA; QSA: four QSA layers;
sizes in packages/sa-layers/benchmarks/_cp_models.py) and the same global row. Rank 0 runs the
whole row alone (no process group: the reference); then every rank runs its contiguous shard of the
row over the CP group of all ranks (at world size 1 a group of one rank: the models' CP path, whose
collectives are then the identity). Rank 0 compares, for each model and batch:

    logits   the ranks' shards gathered along the sequence, against the reference's
    loss     the LM loss (and the indexers' distillation loss) averaged over the ranks
    grads    every parameter's gradient averaged over the ranks, all together and the worst one
    routes   every indexer's selected ids gathered along the sequence: identical rows

Errors are max_abs = max |Δ|, max_rel = max |Δ| / max |ref| and norm_rel = ‖Δ‖ / ‖ref‖; a check
passes when norm_rel <= tol and max_rel <= 4 · tol, with tol per dtype (`TOLERANCES`: BF16 on
CUDA, FP32 on the CPU). Batches: "plain" (one document) and, with --packed, "packed" (five
documents of random lengths whose boundaries fall inside and across shards: Step-5 positions
restarting at 0 and a padding tail, QSA `cu_seqlens`).

With --fsdp-dp D, FSDP2 × CP on a 2-D DeviceMesh (dp D × cp world/D; parameters sharded over the
flattened dp × cp mesh): dp rank d trains on its own row, sharded over its CP group, for --steps
AdamW steps; each step's loss (the mean over the world) is compared with rank 0 training the same
model on the D rows unsharded (their mean loss). NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 unless set). Prints a table on rank 0,
writes JSON with --json, and exits 1 on rank 0 when a check fails.

From the repo root, the workspace packages importable (the uv venv, or PYTHONPATH=packages/*/src):

    # one H200: world size 1 on NCCL (a CP group of one rank), FSDP2 on a 1 × 1 mesh
    torchrun --nproc-per-node 1 tools/cp_parity.py --tokens 32768 --packed --fsdp-dp 1 --steps 20 \
        --json cp_parity_1gpu.json
    # 2, 4, 8 H200s: 32k and 128k global tokens, FSDP2 dp 1 × cp 2, dp 2 × cp 2, dp 2 × cp 4
    torchrun --nproc-per-node 2 tools/cp_parity.py --tokens 32768 131072 --packed --fsdp-dp 1 --json cp_parity_2gpu.json
    torchrun --nproc-per-node 4 tools/cp_parity.py --tokens 32768 131072 --packed --fsdp-dp 2 --json cp_parity_4gpu.json
    torchrun --nproc-per-node 8 tools/cp_parity.py --tokens 32768 131072 --packed --fsdp-dp 2 --json cp_parity_8gpu.json
    # CPU, gloo, tiny models
    torchrun --nproc-per-node 2 tools/cp_parity.py --device cpu --tokens 64 --packed --fsdp-dp 1 --steps 3
"""

from __future__ import annotations

import os

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packages/sa-layers/benchmarks"))
import _cp_models as cpm  # noqa: E402
from _timing import log  # noqa: E402

from sa_cp import gather_no_grad  # noqa: E402

TOLERANCES = {
    torch.float32: {"logits": 1e-5, "loss": 1e-5, "grads": 1e-4, "train": 1e-4},
    torch.bfloat16: {"logits": 2e-2, "loss": 5e-3, "grads": 5e-2, "train": 2e-2},
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# -- comparing ---------------------------------------------------------------------------------------


def errors(got: torch.Tensor, want: torch.Tensor, tol: float) -> dict:
    """max_abs, max_rel, norm_rel of `got` against `want`, and whether they are within `tol`."""
    got, want = got.float(), want.float()
    diff = got - want
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    scale = want.abs().max().item() if want.numel() else 0.0
    norm = torch.linalg.vector_norm(want).item()
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    norm_diff = torch.linalg.vector_norm(diff).item()
    norm_rel = norm_diff / norm if norm > 0 else (0.0 if norm_diff == 0 else float("inf"))
    ok = norm_rel <= tol and max_rel <= 4 * tol
    return {"max_abs": max_abs, "max_rel": max_rel, "norm_rel": norm_rel, "tol": tol, "pass": ok}


def route_errors(got: list[torch.Tensor], want: list[torch.Tensor], tolerance: float) -> dict:
    """Rows (one per query and group) whose selected ids differ, over every routed layer."""
    if len(got) != len(want):
        return {"rows": 0, "differ": -1, "fraction": 1.0, "pass": False}
    rows = differ = 0
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            return {"rows": 0, "differ": -1, "fraction": 1.0, "pass": False}
        rows += a[..., 0].numel()
        differ += int((a != b).any(-1).sum())
    fraction = differ / max(1, rows)
    return {"rows": rows, "differ": differ, "fraction": fraction, "pass": fraction <= tolerance}


def trainable(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def flat_grads(model) -> torch.Tensor:
    """Every trainable parameter's gradient, FP32, flattened and concatenated (zeros where None)."""
    return torch.cat(
        [
            (
                torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float()
            ).flatten()
            for _, p in trainable(model)
        ]
    )


# -- one parity case ---------------------------------------------------------------------------------


def prepare(args, kind: str, device: torch.device):
    model = cpm.build(kind, args.size, device, args.dtype, seed=args.seed)
    model.set_indexer_training(args.indexer_training)
    if args.checkpointing:
        model.enable_activation_checkpointing()
    return model


def parity_case(args, kind: str, packed: bool, tokens: int, group, device) -> list[dict]:
    """Reference (rank 0) and CP run of one model on one row; rank 0 returns the checks."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    model = prepare(args, kind, device)
    routes = cpm.record_routes(model)
    batch = cpm.make_batch(kind, args.size, tokens, packed, device, seed=args.seed + 1)
    ref = None
    if rank == 0:
        out = cpm.run(kind, model, batch)
        cpm.objective(out).backward()
        ref = {
            "logits": out.logits.detach(),
            "loss": out.loss.detach(),
            "indexer_loss": None if out.indexer_loss is None else out.indexer_loss.detach(),
            "grads": flat_grads(model),
            "routes": list(routes),
        }
        del out
        model.zero_grad(set_to_none=True)
    routes.clear()
    dist.barrier()
    out = cpm.run(kind, model, batch, shard=(rank, size), group=group)
    cpm.objective(out).backward()
    logits = gather_no_grad(out.logits.detach(), group, dim=1)
    indexer_loss = out.loss.new_zeros(()) if out.indexer_loss is None else out.indexer_loss
    losses = torch.stack([out.loss.detach().float(), indexer_loss.detach().float()])
    dist.all_reduce(losses, group=group)
    losses /= size
    grads = flat_grads(model)
    dist.all_reduce(grads, group=group)
    grads /= size
    dim = cpm.route_dim(kind)
    cp_routes = [gather_no_grad(r, group, dim=dim) for r in routes]
    if rank != 0:
        return []
    tol = TOLERANCES[args.dtype]
    name = {"model": kind, "batch": "packed" if packed else "plain", "tokens": tokens}
    checks = [
        {**name, "check": "logits", **errors(logits, ref["logits"], tol["logits"])},
        {**name, "check": "loss", **errors(losses[0], ref["loss"], tol["loss"])},
    ]
    if ref["indexer_loss"] is not None:
        checks.append(
            {**name, "check": "indexer loss", **errors(losses[1], ref["indexer_loss"], tol["loss"])}
        )
    params = trainable(model)
    checks.append(
        {
            **name,
            "check": f"grads ({len(params)} tensors)",
            **errors(grads, ref["grads"], tol["grads"]),
        }
    )
    per_tensor, offset = [], 0
    for pname, p in params:
        n = p.numel()
        e = errors(grads[offset : offset + n], ref["grads"][offset : offset + n], tol["grads"])
        per_tensor.append((pname, e))
        offset += n
    failing = [x for x in per_tensor if not x[1]["pass"]]
    pname, e = max(failing or per_tensor, key=lambda x: x[1]["norm_rel"])
    checks.append({**name, "check": f"worst grad ({len(failing)} fail): {pname}", **e})
    checks.append(
        {**name, "check": "routes", **route_errors(cp_routes, ref["routes"], args.route_tolerance)}
    )
    return checks


# -- FSDP2 × CP training -----------------------------------------------------------------------------


def train_reference(args, kind, batches, device) -> torch.Tensor:
    """Rank 0: the model trained unsharded on every row (their mean objective per step)."""
    model = prepare(args, kind, device)
    optimizer = torch.optim.AdamW([p for _, p in trainable(model)], lr=args.lr, foreach=False)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for batch in batches:
            loss = cpm.objective(cpm.run(kind, model, batch)) / len(batches)
            loss.backward()
            total += loss.detach().float()
        optimizer.step()
        losses.append(total)
    return torch.stack(losses)


def shard_model(model, mesh) -> list[torch.nn.Parameter]:
    """fully_shard every decoder layer, then the root (embedding, final norm, LM head). Parameters
    not in the model's dtype (the FP32 norms and indexer weights of a BF16 model; an FSDP2 group
    holds one dtype) stay whole on every rank; they are returned, for `average_kept_grads`."""
    dtype = model.embed_tokens.weight.dtype
    kept = [p for p in model.parameters() if p.dtype != dtype]
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=set(kept))
    fully_shard(model, mesh=mesh, ignored_params=set(kept))
    return kept


def average_kept_grads(kept: list[torch.nn.Parameter]) -> None:
    """Average the gradients of the parameters FSDP does not shard over every rank (one
    all-reduce): what FSDP's reduce-scatter does for the others."""
    with_grad = [p for p in kept if p.grad is not None]
    if not with_grad:
        return
    flat = torch.cat([p.grad.float().flatten() for p in with_grad])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for p, g in zip(with_grad, flat.split([p.numel() for p in with_grad]), strict=True):
        p.grad.copy_(g.view_as(p.grad))


def train_sharded(args, kind, batches, mesh, device) -> torch.Tensor:
    """Every rank: FSDP2 over the flattened dp × cp mesh, this rank's row sharded over its CP
    group; the world's mean objective per step."""
    dp, cp = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    cp_group, cp_size = mesh["cp"].get_group(), mesh["cp"].size()
    model = prepare(args, kind, device)
    kept = shard_model(model, mesh["dp", "cp"]._flatten("dp_cp"))
    optimizer = torch.optim.AdamW([p for _, p in trainable(model)], lr=args.lr, foreach=False)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = cpm.objective(cpm.run(kind, model, batches[dp], shard=(cp, cp_size), group=cp_group))
        loss.backward()
        average_kept_grads(kept)
        optimizer.step()
        losses.append(loss.detach().float())
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    return losses / dist.get_world_size()


def training_case(args, kind: str, packed: bool, tokens: int, mesh, device) -> list[dict]:
    dp_size = mesh["dp"].size()
    batches = [
        cpm.make_batch(kind, args.size, tokens, packed, device, seed=args.seed + 1 + d)
        for d in range(dp_size)
    ]
    ref = train_reference(args, kind, batches, device) if dist.get_rank() == 0 else None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    losses = train_sharded(args, kind, batches, mesh, device)
    if dist.get_rank() != 0:
        return []
    rel = ((losses - ref).abs() / ref.abs().clamp(min=1e-12)).max().item()
    tol = TOLERANCES[args.dtype]["train"]
    return [
        {
            "model": kind,
            "batch": "packed" if packed else "plain",
            "tokens": tokens,
            "check": f"FSDP2 dp {dp_size} × cp {mesh['cp'].size()}, {args.steps} steps: loss",
            "max_abs": (losses - ref).abs().max().item(),
            "max_rel": rel,
            "norm_rel": (
                torch.linalg.vector_norm(losses - ref) / torch.linalg.vector_norm(ref)
            ).item(),
            "tol": tol,
            "pass": rel <= tol,
            "losses": losses.tolist(),
            "reference_losses": ref.tolist(),
        }
    ]


# -- the command -------------------------------------------------------------------------------------


def table(checks: list[dict]) -> str:
    lines = [
        f"{'model':6} {'batch':6} {'tokens':>7}  {'check':56} {'max_abs':>9} {'max_rel':>9} "
        f"{'norm_rel':>9} {'tol':>8}  ok"
    ]
    for c in checks:
        if c["check"] == "routes":
            numbers = f"{c['differ']} of {c['rows']} rows differ".rjust(48)
        else:
            numbers = (
                f"{c['max_abs']:9.2e} {c['max_rel']:9.2e} {c['norm_rel']:9.2e} {c['tol']:8.1e}"
            )
        lines.append(
            f"{c['model']:6} {c['batch']:6} {c['tokens']:>7}  {c['check'][:56]:56} {numbers}  "
            f"{'yes' if c['pass'] else 'NO'}"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--backend", choices=("nccl", "gloo"), help="default: nccl on cuda, gloo on cpu"
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument(
        "--size", choices=cpm.SIZES, help="model sizes; default: small on cuda, tiny on cpu"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        help="global tokens per row (default: 32768 on cuda, 64 on cpu)",
    )
    parser.add_argument("--model", choices=("step5", "qsa", "both"), default="both")
    parser.add_argument("--packed", action="store_true", help="also run the packed batch")
    parser.add_argument(
        "--indexer-training",
        choices=("off", "dense_warmup", "sparse"),
        default="sparse",
        help="indexer training stage: 'sparse' adds the distillation loss and its gradients",
    )
    parser.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing, routes replayed"
    )
    parser.add_argument(
        "--fsdp-dp", type=int, help="also train FSDP2 on a dp × cp mesh of this dp size"
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps with --fsdp-dp")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--route-tolerance",
        type=float,
        default=0.0,
        help="fraction of route rows allowed to differ",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    args.backend = args.backend or ("nccl" if gpu else "gloo")
    args.dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    args.size = args.size or ("small" if gpu else "tiny")
    args.tokens = args.tokens or [32768 if gpu else 64]
    args.kinds = cpm.KINDS if args.model == "both" else (args.model,)
    return parser, args


def _report(args, world: int, checks: list[dict], started: float) -> int:
    """Rank 0's table (and --json report) of the checks; 0 if all passed, else 1."""
    passed = all(c["pass"] for c in checks)
    print(
        f"cp_parity: world size {world} ({args.backend}, {args.device}, {str(args.dtype).removeprefix('torch.')}, "
        f"size {args.size}), indexer training {args.indexer_training}"
        f"{', checkpointing' if args.checkpointing else ''}: {'PASS' if passed else 'FAIL'}"
    )
    print(table(checks))
    if args.json:
        report = {
            "world_size": world,
            "backend": args.backend,
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "dtype": str(args.dtype).removeprefix("torch."),
            "size": args.size,
            "geometry": {k: cpm.geometry(k, args.size) for k in args.kinds},
            "indexer_training": args.indexer_training,
            "checkpointing": args.checkpointing,
            "torch": torch.__version__,
            "seconds": round(time.perf_counter() - started, 1),
            "passed": passed,
            "checks": checks,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if passed else 1


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    rank, world, device = cpm.init_distributed(args.backend, args.device)
    try:
        for tokens in args.tokens:
            for kind in args.kinds:
                multiple = cpm.shard_multiple(kind, args.size)
                if tokens % world or (tokens // world) % multiple:
                    parser.error(
                        f"--tokens {tokens}: {world} shards of a multiple of {multiple} tokens ({kind})"
                    )
        if args.fsdp_dp is not None and (args.fsdp_dp < 1 or world % args.fsdp_dp):
            parser.error(f"--fsdp-dp {args.fsdp_dp} must divide the world size {world}")
        started = time.perf_counter()
        cp_group = init_device_mesh(args.device, (world,), mesh_dim_names=("cp",)).get_group()
        checks: list[dict] = []
        batches = (False, True) if args.packed else (False,)
        for tokens in args.tokens:
            for kind in args.kinds:
                for packed in batches:
                    checks += parity_case(args, kind, packed, tokens, cp_group, device)
                    if rank == 0:
                        log(f"{kind} {'packed' if packed else 'plain'} {tokens}", started)
        if args.fsdp_dp is not None:
            mesh = init_device_mesh(
                args.device, (args.fsdp_dp, world // args.fsdp_dp), mesh_dim_names=("dp", "cp")
            )
            for kind in args.kinds:  # at the first --tokens
                for packed in batches:
                    checks += training_case(args, kind, packed, args.tokens[0], mesh, device)
        code = _report(args, world, checks, started) if rank == 0 else 0
        # the ranks leave together: tearing gloo down while a peer still works can abort it
        dist.barrier()
        return code
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
