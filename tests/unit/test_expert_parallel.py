"""Expert parallelism over 2 CPU processes (gloo) equals one rank: the MoE block alone.

Each rank holds half the experts and its own tokens (data-parallel attention); tokens travel to
their experts' ranks and back through torch.distributed all_to_all. The ranks write their
outputs to files; the test compares them with one SparseMoeBlock holding every expert.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from minivllm.models.arch import MoEConfig

HIDDEN, SEED = 32, 7
MOE = MoEConfig(num_experts=8, top_k=3, intermediate_size=24, norm_topk_prob=True, shared_expert_intermediate_size=16)
# tokens per rank: unequal, and a rank with none
SPLITS = [(5, 7), (0, 6)]


def _full_block(placement=None, comm=None):
    from minivllm.models.expert_parallel import ExpertPlacement
    from minivllm.models.moe import SparseMoeBlock
    torch.manual_seed(SEED)
    full = SparseMoeBlock(HIDDEN, MOE)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.3)
        full.gate.weight[:, :4] += 2.0  # skewed: some experts (and so some rank pairs) get few or no tokens
    if placement is None:
        return full
    block = SparseMoeBlock(HIDDEN, MOE, placement, comm)
    own = slice(placement.first, placement.first + placement.num_local)
    state = {k: (v[own] if k.startswith("experts.") else v) for k, v in full.state_dict().items()}
    block.load_state_dict(state)
    assert isinstance(placement, ExpertPlacement)
    return block


def _tokens(n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(SEED + 1)) * 2


def _rank_main(rank: int, port: int, splits: tuple[int, int], out_dir: str, backend: str = "gloo") -> None:
    """One rank: its half of the experts, its slice of the tokens (nccl: on GPU `rank`)."""
    import torch.distributed as dist

    from minivllm.models.expert_parallel import ExpertPlacement, TorchDistComm
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        block = _full_block(ExpertPlacement(MOE.num_experts, 2, rank), TorchDistComm()).to(device)
        x = _tokens(sum(splits))[sum(splits[:rank]):sum(splits[:rank + 1])].to(device)
        with torch.no_grad():
            out = block(x)
        torch.save({"out": out.cpu(), "counts": block.token_counts.cpu()}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(splits: tuple[int, int], out_dir, backend: str, device: str, rtol: float, atol: float) -> None:
    """2 ranks through `backend` against one block holding every expert on `device`."""
    mp.spawn(_rank_main, args=(_free_port(), splits, str(out_dir), backend), nprocs=2, join=True)
    parts = [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]
    full = _full_block().to(device)
    with torch.no_grad():
        want = full(_tokens(sum(splits)).to(device)).cpu()
    got = torch.cat([p["out"] for p in parts])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    # each rank counted its own tokens, over every expert (global ids)
    assert torch.equal(parts[0]["counts"] + parts[1]["counts"], full.token_counts.cpu())


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: f"{s[0]}+{s[1]}tokens")
def test_two_ranks_gloo_equal_one_rank(splits, tmp_path):
    run_two_ranks(splits, tmp_path, "gloo", "cpu", rtol=1e-5, atol=1e-6)
