"""remat under data parallelism, on two gloo ranks: `torch.compile(DDP(model), backend="remat")`
(DDP's graph is split at its gradient buckets by Dynamo's DDPOptimizer; remat rewrites each piece,
the loss chunk included) and FSDP2 (`fully_shard`) with each block compiled with remat, as torch
recommends for FSDP2 (a whole-model compile falls back to eager at FSDP2's hooks, remat or not).
The gradients are those of the same step run eagerly under DDP."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

# The loss chunk fires: 4 x 128 tokens x 8192 classes of fp32 logits are 16 MiB. One block: FSDP2
# shards and compiles it as it would each of many.
CONFIG = dict(vocab=8192, d_model=32, layers=1, heads=2, seq=128, batch=4)


def _rank(rank: int, world: int, init: str, out: str) -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import backends.fx as fx_backend
    from backends.fx.saved import relative_error
    from backends.models import GPTConfig, gpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cfg = GPTConfig(**CONFIG)
    g = torch.Generator().manual_seed(rank)         # each rank its own batch
    inputs = tuple(torch.randint(0, cfg.vocab, t.shape, generator=g) for t in gpt(cfg).example_inputs())

    def fresh():
        torch.manual_seed(0)
        return gpt(cfg)

    reference = DDP(fresh())
    reference(*inputs).backward()
    want = [p.grad for p in reference.module.parameters()]
    results = {}
    # Scalar C++ kernels, as the suite's own compiles (tests/conftest.py: a vectorized kernel is
    # dearer to compile, and the ranks' plans and numbers hold either way).
    with inductor_config.patch({"fx_graph_cache": False, "cpp.simdlen": 1}), \
            functorch_config.patch(enable_autograd_cache=False):
        model = fresh()
        remat = fx_backend.backend(strict=True)
        ddp = DDP(model)        # held: a DDP dropped before backward would average nothing
        torch.compile(ddp, backend=remat)(*inputs).backward()
        results["ddp"] = {"error": max(relative_error(p.grad, w) for p, w in zip(model.parameters(), want)),
                          "graphs": len(remat.remat_pass.results), "chunked": remat.remat_pass.chunked}
        torch._dynamo.reset()
        model = fresh()
        remat = fx_backend.backend(strict=True)
        for block in model.blocks:
            block.compile(backend=remat)
            fully_shard(block)
        fully_shard(model)
        model(*inputs).backward()
        results["fsdp2"] = {"error": max(relative_error(p.grad.full_tensor(), w)
                                         for p, w in zip(model.parameters(), want)),
                            "graphs": len(remat.remat_pass.results), "chunked": remat.remat_pass.chunked}
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_ddp_and_fsdp2_steps_with_remat_match_the_eager_ddp_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    monkeypatch.setenv("REMAT_STRICT", "1")
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        ddp, fsdp2 = results["ddp"], results["fsdp2"]
        assert ddp["graphs"] >= 1 and ddp["chunked"] == 1, ddp          # the loss chunked under DDP
        assert fsdp2["graphs"] >= 1, fsdp2                               # the blocks rewritten
        assert ddp["error"] <= 1e-4 and fsdp2["error"] <= 1e-4, results
