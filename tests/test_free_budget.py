"""The `free` budget on the torch path: the fastest plans that fit what the device has free when the
graph compiles, less the optimizer state to come (backends/fx/free_memory.py)."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import backends.fx.compile as fx_compile  # noqa: E402
from backends.fx import free_memory  # noqa: E402
from backends.fx.saved import relative_error, training_step  # noqa: E402
from backends.models import MLP  # noqa: E402
from dsl.loader import load_rules  # noqa: E402
from engine.errors import ConfigError  # noqa: E402

MiB = 2**20


def _case():
    torch.manual_seed(0)
    model = MLP([256, 1024, 1024, 64], "gelu")
    inputs = (torch.randn(256, 256), torch.randn(256, 64))
    return model, inputs


def _compiled_step(model, inputs, budget: str = "free"):
    reports: list[str] = []
    backend = fx_compile.backend(budget=budget, report=reports.append, strict=False, device="cpu-default")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads, _ = training_step(model, torch.compile(model, backend=backend), inputs)
    remat_warnings = [str(w.message) for w in caught if str(w.message).startswith("remat:")]
    return loss, grads, reports, remat_warnings, backend.remat_pass


def _chosen(report: str) -> int:
    return int(report.split(" plan occurrence(s) chosen")[0].rsplit(", ", 1)[1])


def test_a_step_that_fits_the_free_memory_is_compiled_without_plans(fresh_compiles, monkeypatch):
    model, inputs = _case()
    want_loss, want_grads, _ = training_step(model, model, inputs)
    monkeypatch.setattr(fx_compile, "free_bytes", lambda device: 64 * 2**30)
    loss, grads, reports, caught, remat_pass = _compiled_step(model, inputs)
    assert not caught
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())
    [line] = remat_pass.free_resolved
    assert line.startswith("remat: budget free on cpu: 64.00 GiB free") and "kept back" in line
    # rounded down to 1/64 of 32 GiB
    assert remat_pass.budget.bytes == int(0.9 * (64 * 2**30 - 2 * trainable)) // 2**29 * 2**29
    [table] = [r for r in reports if "Budget " in r]
    assert _chosen(table) == 0 and "Applied 0 recompute region(s)" in table
    assert "no plan, not simulated" in table and "simulates at" not in table     # engine.driver.CLEARLY_FITS
    assert relative_error(loss, want_loss) <= 1e-5
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) <= 1e-5


def test_a_tight_device_gets_the_plans_its_free_memory_needs(fresh_compiles, monkeypatch):
    """8.3 MiB of activations by the estimate (2 MiB of them GELU outputs, 4.25 transposed weights):
    8 MiB free after the reserve takes some plans, not all; nothing left takes the lowest peak's."""
    model, inputs = _case()
    want_loss, want_grads, _ = training_step(model, model, inputs)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(fx_compile, "free_bytes", lambda device: 2 * trainable + int(8.5 * MiB / 0.9))
    loss, grads, reports, caught, remat_pass = _compiled_step(model, inputs)
    assert not caught and remat_pass.budget.bytes == 8 * MiB
    [table] = [r for r in reports if "Budget " in r]
    simulated = float(table.split("simulates at ")[1].split(" MiB")[0])
    assert 0 < _chosen(table) and simulated <= 8.0
    assert relative_error(loss, want_loss) <= 1e-5
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) <= 1e-5

    torch._dynamo.reset()
    # An explicit reserve replaces the optimizer's: 8.5 MiB / 0.9 free less all of it is nothing left
    monkeypatch.setattr(fx_compile, "free_bytes", lambda device: int(8.5 * MiB / 0.9))
    loss, grads, reports, caught, remat_pass = _compiled_step(model, inputs, budget="free-9MiB")
    [message] = caught
    assert "cannot be reached" in message and "budget free-9.00MiB on cpu" in message and "9.00 MiB kept back" in message
    assert relative_error(loss, want_loss) <= 1e-5


def test_a_device_whose_free_memory_is_unknown():
    with pytest.raises(free_memory.FreeMemoryUnknown, match="meta device"):
        free_memory.free_bytes(torch.device("meta"))
    inputs = [torch.nn.Parameter(torch.zeros(4, 4, device="meta")), torch.zeros(3, device="meta")]
    assert free_memory.input_device(inputs).type == "meta"
    assert free_memory.optimizer_reserve(free_memory.trainable_bytes(inputs)) == 2 * 4 * 4 * 4
    strict = fx_compile.RematPass(load_rules(), budget="free", strict=True)
    with pytest.raises(ConfigError, match="budget free: the free memory of a meta device"):
        strict.on_device(inputs)
    lenient = fx_compile.RematPass(load_rules(), budget="free", strict=False)
    with pytest.warns(RuntimeWarning, match="planning without a budget"):
        lenient.on_device(inputs)
    assert lenient.budget is None and lenient.free_budget is not None

    def broken(device):
        raise RuntimeError("CUDA driver error: unknown error")

    lenient.budget = None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fx_compile, "free_bytes", broken)
        with pytest.warns(RuntimeWarning, match="reading the device's free memory failed"):
            lenient.on_device(inputs)       # the step compiles, without a budget
        with pytest.raises(RuntimeError, match="driver error"):
            strict.on_device(inputs)


def test_the_cpu_free_memory_is_the_kernels_within_the_cgroups_limits(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    cgroup, own = tmp_path / "cgroup", tmp_path / "self_cgroup"
    cgroup.mkdir()
    for name, value in (("MEMINFO", meminfo), ("CGROUP", cgroup), ("PROC_CGROUP", own)):
        monkeypatch.setattr(free_memory, name, value)
    cpu = torch.device("cpu")
    available = 20000000 * 1024
    assert free_memory.free_bytes(cpu) == available                        # no cgroups at all

    def write(folder, **files):
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (folder / name.replace("_", ".", 1)).write_text(text)

    # cgroup v2: a job's cgroup inside a slice, each with a limit; the tighter one counts
    own.write_text("0::/slice/job\n")
    write(cgroup, cgroup_controllers="memory\n")
    write(cgroup / "slice", memory_max=f"{16 * 2**30}\n", memory_current=f"{2 * 2**30}\n")
    write(cgroup / "slice" / "job", memory_max="max\n", memory_current=f"{2**30}\n")
    assert free_memory.free_bytes(cpu) == 14 * 2**30
    write(cgroup / "slice" / "job", memory_max=f"{8 * 2**30}\n", memory_current=f"{3 * 2**30}\n",
          memory_stat=f"anon 123\ninactive_file {2**30}\n")
    assert free_memory.free_bytes(cpu) == 6 * 2**30                        # 8 - (3 - 1 of page cache)

    # cgroup v1's memory controller, beside other controllers; "no limit" is a huge number
    (cgroup / "cgroup.controllers").unlink()
    own.write_text("5:devices:/\n4:memory:/jobs/42\n0::/\n")
    write(cgroup / "memory" / "jobs" / "42", memory_limit_in_bytes="9223372036854771712\n",
          memory_usage_in_bytes=f"{2**30}\n")
    assert free_memory.free_bytes(cpu) == available
    write(cgroup / "memory" / "jobs" / "42", memory_limit_in_bytes=f"{4 * 2**30}\n",
          memory_stat=f"total_inactive_file {2**29}\n")
    assert free_memory.free_bytes(cpu) == 3 * 2**30 + 2**29

    meminfo.write_text("MemTotal:       24000000 kB\n")
    with pytest.raises(free_memory.FreeMemoryUnknown, match="MemAvailable"):
        free_memory.free_bytes(cpu)


def test_a_gpus_free_memory_counts_the_allocators_cache_within_its_cap(monkeypatch):
    gib = 2**30
    cuda = torch.device("cuda", 0)
    for name, value in (("mem_get_info", lambda d: (10 * gib, 80 * gib)), ("memory_allocated", lambda d: 30 * gib),
                        ("memory_reserved", lambda d: 34 * gib), ("get_per_process_memory_fraction", lambda d: 1.0)):
        monkeypatch.setattr(torch.cuda, name, value)
    assert free_memory.free_bytes(cuda) == 14 * gib      # the driver's 10 and the 4 cached, unallocated
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 0.5)
    assert free_memory.free_bytes(cuda) == 10 * gib      # capped at 40 of 80, 30 allocated


def test_launchers_that_pass_no_options_set_the_budget_and_tiers_by_environment(monkeypatch):
    """transformers' Trainer compiles with `torch_compile_backend="remat"` and a mode, never options:
    REMAT_BUDGET and REMAT_TIERS reach the registered backend, unless its options say otherwise."""
    seen = []
    monkeypatch.setattr(fx_compile, "backend", lambda **kw: seen.append(kw) or (lambda gm, inputs: gm))
    monkeypatch.setattr(fx_compile, "_CONFIGURED", {})       # the configured backends, made here
    monkeypatch.setenv("REMAT_BUDGET", "free-1GiB")
    monkeypatch.setenv("REMAT_TIERS", "expensive")
    fx_compile.remat_backend(None, [], mode="max-autotune")
    assert str(seen[-1]["budget"]) == "free-1.00GiB" and seen[-1]["tiers"] == ["expensive"]
    assert seen[-1]["mode"] == "max-autotune"
    fx_compile.remat_backend(None, [], options={"config": "Gelu+:1:-1", "tiers": []})
    assert "budget" not in seen[-1] and seen[-1]["tiers"] == []          # the options win
    fx_compile.remat_backend(None, [], options={"ratio": 0.5})
    assert "budget" not in seen[-1] and seen[-1]["ratio"] == 0.5
    monkeypatch.setenv("REMAT_BUDGET", "lots")
    with pytest.raises(ConfigError, match="REMAT_BUDGET: budget 'lots'"):
        fx_compile.remat_backend(None, [])


def test_graphs_split_by_a_graph_break_keep_back_the_optimizer_state_of_every_parameter(monkeypatch):
    """Dynamo compiles a model split by graph breaks graph by graph, each with its own parameters;
    Adam's state is made for all of them after the first step, so each compile keeps back the
    parameters of every graph compiled so far, and reports its reading only when it plans."""
    monkeypatch.setattr(fx_compile, "free_bytes", lambda device: 1000 * MiB)
    first = [torch.nn.Parameter(torch.zeros(16 * MiB // 4)), torch.zeros(4)]        # 16 MiB
    second = [torch.nn.Parameter(torch.zeros(32 * MiB // 4))]                        # 32 MiB
    reports = []
    remat_pass = fx_compile.RematPass(load_rules(), budget="free", report=reports.append)
    remat_pass.on_device(first)
    assert remat_pass.budget.bytes == int(0.9 * (1000 - 32) * MiB) // (8 * MiB) * (8 * MiB)
    remat_pass.on_device(second)
    assert remat_pass.budget.bytes == int(0.9 * (1000 - 96) * MiB) // (8 * MiB) * (8 * MiB)
    remat_pass.on_device(first)             # seen before: not counted twice
    assert remat_pass.budget.bytes == int(0.9 * (1000 - 96) * MiB) // (8 * MiB) * (8 * MiB)
    assert not reports and "96.00 MiB kept back" in remat_pass.unreported


def test_the_registered_backend_keeps_back_the_state_of_every_graph_it_compiled(monkeypatch):
    """torch calls the registered backend once per graph: graphs compiled with the same options
    share one configured backend, so the graph after a break keeps back both graphs' optimizer
    state (it kept back its own only) and `torch._dynamo.reset()` starts afresh."""
    monkeypatch.setattr(fx_compile, "free_bytes", lambda device: 1000 * MiB)

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(512, 512), torch.nn.Linear(512, 1024)   # 1 and 2 MiB

        def forward(self, x):
            y = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(y).square().mean()

    reports: list[str] = []
    options = {"budget": "free", "report": reports.append, "strict": False}
    torch._dynamo.reset()
    torch.compile(Split(), backend="remat", options=options)(torch.randn(8, 512)).backward()
    kept = [r.split(" kept back")[0].rsplit(", ", 1)[1] for r in reports if " kept back" in r]
    assert kept == ["2.00 MiB", "6.01 MiB"], reports
    assert fx_compile._CONFIGURED
    torch._dynamo.reset()
    assert not fx_compile._CONFIGURED


def test_a_rule_file_edited_between_two_compiles_is_read_again(monkeypatch, tmp_path):
    """The registered backend's configured backends are shared by options and by the rules'
    content; a rule file named by the options and edited since (a user tuning a rule in a
    notebook) gets a new one."""
    made = []
    monkeypatch.setattr(fx_compile, "backend", lambda **kw: made.append(kw) or (lambda gm, inputs: gm))
    monkeypatch.setattr(fx_compile, "_CONFIGURED", {})
    rule = tmp_path / "mine.rule"
    rule.write_text("use std.ops\n")
    options = {"rules": [str(rule)]}
    fx_compile.remat_backend(None, [], options=options)
    fx_compile.remat_backend(None, [], options=dict(options))
    assert len(made) == 1                                   # the same options: one configured backend
    rule.write_text("use std.ops\n# tuned\n")
    fx_compile.remat_backend(None, [], options=options)
    assert len(made) == 2


def test_choose_shows_what_the_backend_would_choose_for_a_device_without_compiling(fresh_compiles, capsys):
    """`backends.fx.choose`: the planner's choice at a budget for a named device (a GPU planned for on
    this CPU), as the backend would make it; the same choice as the compiled backend's for the same
    device, and a free budget, which only a compile can read, refused."""
    from backends.fx import choose

    model, inputs = _case()
    [planned] = choose(model, inputs, "0.95", device="cpu-default")
    printed = capsys.readouterr().out
    assert planned.choice is not None and planned.choice.selection
    assert all(p.grad is None for p in model.parameters())
    _, _, reports, _, _ = _compiled_step(model, inputs, budget="0.95")
    [table] = [r for r in reports if "Budget " in r]
    budget_line = next(line for line in table.splitlines() if line.startswith("Budget "))
    assert budget_line in printed and budget_line in planned.report()
    [for_gpu] = choose(model, inputs, "0.95", device="h100", show=False)
    assert for_gpu.choice.budget == planned.choice.budget and capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match="choose\\(\\) compiles nothing"):
        choose(model, inputs, "free")
