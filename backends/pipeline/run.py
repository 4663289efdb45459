"""One training step of the GPT-like model on torch.distributed.pipelining, one stage per rank.

Each rank builds the whole model from the same seed, keeps its stage (backends.pipeline.stages),
compiles it (with `backend="remat"` and the stage's own plan, or a baseline: eager, Inductor,
per-block torch.utils.checkpoint, remat at a ratio) and runs `PipelineStage` under
`Schedule1F1B` or `ScheduleGPipe`. After two warm-up steps it measures one step's peak the way
the README's Benchmarks do (`/proc/self/clear_refs`, then VmHWM above the resting VmRSS; the
launcher sets MALLOC_MMAP_THRESHOLD_=65536 so freed buffers leave the process), times a few
steps, and checks the step's loss and its stage's gradients against the single-process step
on the whole batch. Rank 0 gathers every rank's result.

    torchrun --nproc-per-node 4 -m backends.pipeline.run RUN.json --out DIR   (gloo on CPU)

On GPUs the same file runs with NCCL (docs/pipeline.md): RUN.json's "device" is "cuda", each
rank takes GPU LOCAL_RANK and its peak is torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

MODES = ("eager", "compile", "checkpoint", "remat")
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


@dataclass(frozen=True)
class PipelineRun:
    """What every rank runs: the model (its `batch` is one micro-batch), the schedule, where the
    stages start, and how each stage is compiled."""

    model: dict                                   # GPTConfig's fields
    microbatches: int
    boundaries: tuple[int, ...]                   # first layer of each stage
    schedule: str = "1f1b"
    mode: str = "remat"                           # eager | compile | checkpoint | remat
    configs: tuple[str, ...] = ()                 # remat: each stage's plans (a config string; "": none)
    tiers: tuple[str, ...] = ()
    estimates: tuple[float, ...] = ()             # the plan's activation bytes per rank, to print beside
    statics: tuple[float, ...] = ()               # the plan's weights and optimizer bytes per rank
    limit: float | None = None                    # bytes per rank, to say what fits
    steps: int = 3                                # timed steps after the measured one
    warmup: int = 2
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: expected one of {', '.join(MODES)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: runs take {', '.join(SCHEDULES)}")

    @staticmethod
    def from_json(data: dict) -> "PipelineRun":
        known = {f.name for f in fields(PipelineRun)}
        return PipelineRun(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known})


@dataclass
class RankResult:
    rank: int
    layers: list[int]
    rest: int                      # bytes resident before the measured step
    peak: int                      # bytes above rest during it
    static: int                    # bytes of the stage's parameters and gradients
    seconds: float                 # median step time
    compile_seconds: float         # the first step less a step
    loss_error: float | None = None        # relative, the last rank's
    grad_error: float = 0.0                # largest relative error of its gradients
    estimate: float | None = None
    loss: float | None = None
    saved: list[list] = field(default_factory=list)   # [shape, dtype] of what one forward keeps for backward


def compile_stage(stage, run: PipelineRun, index: int, torch):
    """The stage module as `run.mode` compiles it."""
    if run.mode == "eager":
        return stage
    if run.mode == "checkpoint":
        import torch.utils.checkpoint as checkpoint

        for block in stage.blocks:
            block.forward = (lambda f: lambda x: checkpoint.checkpoint(f, x, use_reentrant=False))(block.forward)
        return torch.compile(stage)
    if run.mode == "compile":
        return torch.compile(stage)
    import backends.fx.compile as fx_compile

    config = run.configs[index] if run.configs else None
    device = "cpu" if run.device == "cpu" else "cuda"
    if config == "":            # no plan for this stage: the budget of its own estimated peak applies none
        backend = fx_compile.backend(tiers=run.tiers, budget=1.0, device=device)
    else:
        backend = fx_compile.backend(tiers=run.tiers, config=config, device=device)
    return torch.compile(stage, backend=backend)


def saved_by_forward(compiled, example, torch) -> list[list]:
    """What one forward of the compiled stage keeps for its backward, seen by autograd's
    saved-tensor hooks (a plan in effect shows here whether or not Inductor's cache served it)."""
    saved: list[list] = []

    def pack(t):
        saved.append([list(t.shape), str(t.dtype).removeprefix("torch.")])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compiled(example)
    return saved


def run_rank(run: PipelineRun, rank: int, world: int) -> RankResult:
    """This rank's stage, stepped; the process group is initialized."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    from backends.fx.saved import relative_error
    from backends.models import GPTConfig, gpt
    from backends.process_peak import peak_bytes, reset_peak

    from .stages import loss_fn, split

    if len(run.boundaries) != world:
        raise ValueError(f"{len(run.boundaries)} stages for {world} ranks")
    cuda = run.device == "cuda"
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = GPTConfig(**run.model)
    model = gpt(cfg, run.seed).to(device)
    stage = split(model, run.boundaries)[rank]
    compiled = compile_stage(stage, run, rank, torch)
    micro = cfg.batch
    g = torch.Generator().manual_seed(run.seed + 1)
    shape = (micro * run.microbatches, cfg.seq)
    idx = torch.randint(0, cfg.vocab, shape, generator=g).to(device)
    targets = torch.randint(0, cfg.vocab, shape, generator=g).to(device)
    with torch.no_grad():
        x = model.tok(idx[:micro]) + model.pos(torch.arange(cfg.seq, device=device))
    example_in = idx[:micro] if stage.is_first else x.detach().requires_grad_(True)
    out_shape = (micro, cfg.seq, cfg.vocab if stage.is_last else cfg.d_model)
    example_out = torch.zeros(out_shape, device=device, requires_grad=True)
    pipe = pipelining.PipelineStage(compiled, rank, world, device, input_args=(example_in,),
                                    output_args=(example_out,))
    schedule = getattr(pipelining, SCHEDULES[run.schedule])(pipe, run.microbatches, loss_fn=loss_fn)

    def step() -> list:
        losses: list = []
        if world == 1:
            schedule.step(idx, target=targets, losses=losses)
        elif rank == 0:
            schedule.step(idx)
        elif rank == world - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        return losses

    def timed_step() -> tuple[float, list]:
        stage.zero_grad(set_to_none=False)
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        losses = step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - begin, losses

    warm = [timed_step()[0] for _ in range(run.warmup)]
    # The measured step: gradients exist already (zeroed in place), so the peak above rest is
    # the step's activations, workspace and messages.
    stage.zero_grad(set_to_none=False)
    gc.collect()
    dist.barrier()
    rest = reset_peak(cuda)
    losses = step()
    peak = peak_bytes(cuda) - rest
    dist.barrier()
    grads = {name: p.grad.detach().clone() for name, p in stage.named_parameters()}
    loss = torch.stack([l.detach() for l in losses]).mean() if losses else None
    times = [timed_step()[0] for _ in range(run.steps)]
    seconds = sorted(times)[len(times) // 2] if times else warm[-1]

    # The single-process step on the whole batch, eager, from the same initial weights.
    reference = gpt(cfg, run.seed).to(device)
    ref_loss = reference(idx, targets)
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters())
    names = stage.model_names()
    grad_error = max(relative_error(grads[n], ref_grads[names[n]].grad) for n in grads)
    static = sum(2 * p.numel() * p.element_size() for p in stage.parameters())
    result = RankResult(rank, list(range(stage.first, stage.end)), rest, peak, static, seconds,
                        max(0.0, warm[0] - seconds) if warm else 0.0, grad_error=grad_error,
                        estimate=run.estimates[rank] if run.estimates else None)
    result.saved = saved_by_forward(compiled, example_in, torch)
    if loss is not None:
        result.loss = float(loss)
        result.loss_error = relative_error(loss, ref_loss.detach())
    return result


def table(run: PipelineRun, results: list[RankResult]) -> str:
    mib = 2**20
    rows = [f"{'rank':>4}  {'layers':<8} {'static MiB':>10} {'peak MiB':>9} {'estimate':>9} {'meas/est':>9}"
            f"{'fits' if run.limit else '':>6} {'step s':>8} {'compile s':>9} {'grad err':>9} {'loss err':>9}"]
    for r in results:
        est = f"{r.estimate / mib:>9.1f}{r.peak / r.estimate:>10.3f}" if r.estimate else f"{'-':>9}{'-':>10}"
        fits = ""
        if run.limit:
            fits = "yes" if r.peak + r.static <= run.limit else "NO"
        layers = f"{r.layers[0]}-{r.layers[-1]}" if len(r.layers) > 1 else f"{r.layers[0]}"
        loss = f"{r.loss_error:.1e}" if r.loss_error is not None else "-"
        rows.append(f"{r.rank:>4}  {layers:<8} {r.static / mib:>10.1f} {r.peak / mib:>9.1f}{est}{fits:>6} "
                    f"{r.seconds:>8.3f} {r.compile_seconds:>9.1f} {r.grad_error:>9.1e} {loss:>9}")
    return "\n".join(rows)


def _worker(rank: int, world: int, run: PipelineRun, out: str, port: int) -> None:
    """torch.multiprocessing.spawn's entry: one rank, gloo over localhost."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _serve(run, rank, world, Path(out))


def _serve(run: PipelineRun, rank: int, world: int, out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if run.device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        result = run_rank(run, rank, world)
        (out / f"rank{rank}.json").write_text(json.dumps(asdict(result)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(run: PipelineRun, world: int, out: Path, port: int = 29517) -> list[RankResult]:
    """Run `run` on `world` gloo ranks, processes started by torch.multiprocessing; each rank's result."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_worker, args=(world, run, str(out), port), nprocs=world, join=True)
    return read_results(out, world)


def read_results(out: Path, world: int) -> list[RankResult]:
    return [RankResult(**json.loads((out / f"rank{r}.json").read_text())) for r in range(world)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one pipelined GPT step per rank (under torchrun)")
    ap.add_argument("run", help="a JSON file of PipelineRun's fields")
    ap.add_argument("--out", type=Path, required=True, help="folder for each rank's result")
    args = ap.parse_args(argv)
    run = PipelineRun.from_json(json.loads(Path(args.run).read_text()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    args.out.mkdir(parents=True, exist_ok=True)
    _serve(run, rank, world, args.out)
    if rank == 0:
        print(table(run, read_results(args.out, world)))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))
    main()
