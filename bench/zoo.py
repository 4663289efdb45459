"""Run the zoo (tests/zoo.py) through backend=remat, strict, and print a table.

    python bench/zoo.py                   # FIXED
    python bench/zoo.py --hypothesis 5    # and 5 random switch mixes
    python bench/zoo.py --only issue_gpt_scores_div_float_z_loss --timeout 120

`--baseline` also compiles each variant with plain Inductor and shows its errors (a
low-precision variant over its tolerance gets this anyway: it passes within 2x of them).
Each variant runs in its own subprocess with a timeout, so a crash or a hang of one does not
hide the others. Columns: variant, tiers, compiled (strict) ok ("torch": plain Inductor fails on the model
too), loss and max gradient error
against eager (max |got - want| / max |want|), the tolerance, the rules fired (regions per
rule), seconds. Failures are listed after the table with the innermost exception and its
last frames. Last line: the totals and the shipped rules no variant fired.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MARK = "ZOO-RESULT "

SHORT = {"chunk_linear_cross_entropy": "chunk_lce", "chunk_attention_scores": "chunk_att",
         "recompute_activation": "act", "recompute_elementwise": "elt", "recompute_layout": "layout",
         "compromise_widening_cast": "widen", "recompute_cast": "cast", "recompute_softmax": "softmax",
         "recompute_norm": "norm", "recompute_matmul": "matmul"}


def child() -> None:
    import zoo

    spec = json.loads(sys.stdin.read())
    spec["tiers"] = tuple(spec["tiers"])
    spec["expect"] = tuple(spec.get("expect", ()))
    baseline = spec.pop("baseline", None)
    result = zoo.run_variant(zoo.Variant(**spec), baseline=baseline)
    out = dataclasses.asdict(result)
    out["within"] = bool(result.within)
    print(MARK + json.dumps(out), flush=True)


def run_one(variant, timeout: float, baseline: bool | None = None) -> dict:
    spec = dataclasses.asdict(variant)
    spec["baseline"] = baseline
    try:
        proc = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(spec), text=True,
                              capture_output=True, timeout=timeout, cwd=ROOT,
                              env={**os.environ, "REMAT_STRICT": "1"})
    except subprocess.TimeoutExpired:
        return {"name": variant.name, "tiers": list(variant.tiers), "compiled": False,
                "error_type": "Timeout", "error": f"no result within {timeout:.0f} s", "frames": [],
                "fired": {}, "tolerance": variant.tolerance}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-8:]
    return {"name": variant.name, "tiers": list(variant.tiers), "compiled": False,
            "error_type": f"exit {proc.returncode}", "error": "the subprocess died without a result",
            "frames": tail, "fired": {}, "tolerance": variant.tolerance}


def within(r: dict) -> bool:
    return bool(r.get("within"))


def fmt(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hypothesis", type=int, default=0, metavar="N", help="also N random switch mixes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random mixes")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per variant")
    parser.add_argument("--only", nargs="*", help="run only these FIXED variants")
    parser.add_argument("--no-fixed", action="store_true", help="only the random mixes")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--baseline", action="store_true",
                        help="also compile each variant with plain Inductor (its errors against eager)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child()

    import zoo

    variants = [] if args.no_fixed else [v for v in zoo.FIXED if not args.only or v.name in args.only]
    rng = random.Random(args.seed)
    variants += [zoo.random_variant(rng, f"random_{args.seed}_{i}") for i in range(args.hypothesis)]

    head = (f"{'variant':44s} {'tiers':9s} {'ok':4s} {'loss err':>8s} {'grad err':>8s} {'tol':>5s}  {'s':>5s}  "
            f"rules fired")
    print(head)
    print("-" * len(head))
    results = []
    for v in variants:
        r = run_one(v, args.timeout, True if args.baseline else None)
        results.append((v, r))
        ok = "yes" if r.get("compiled") else ("torch" if r.get("torch_error") else "NO")
        if r.get("compiled") and not within(r):
            ok = "num"
        missing = [x for x in v.expect if not r.get("fired", {}).get(x)]
        fired = " ".join(f"{SHORT.get(k, k)}={n}" for k, n in r.get("fired", {}).items()) or "-"
        if missing:
            fired += "  (expected, not fired: " + ", ".join(SHORT.get(m, m) for m in missing) + ")"
        if r.get("base_grad_err") is not None:
            fired += f"  [plain Inductor: loss {fmt(r['base_loss_err'])}, grad {fmt(r['base_grad_err'])}]"
        print(f"{v.name:44s} {','.join(v.tiers) or 'default':9s} {ok:4s} {fmt(r.get('loss_err')):>8s} "
              f"{fmt(r.get('grad_err')):>8s} {r['tolerance']:5.0e}  {r.get('seconds', 0):5.1f}  {fired}",
              flush=True)

    failed = [(v, r) for v, r in results if not r.get("compiled")]
    if failed:
        print("\nFailures:")
        for v, r in failed:
            print(f"\n{v.name} [{v.switches()}; tiers {','.join(v.tiers) or 'default'}]: "
                  f"{r.get('error_type')}: {r.get('error')}")
            if r.get("torch_error"):
                print(f"    (plain Inductor fails too, torch's bug: {r['torch_error'][:200]})")
            for frame in r.get("frames", []):
                print(f"    {frame}")
    off = [(v, r) for v, r in results if r.get("compiled") and not within(r)]
    if off:
        print("\nOutside tolerance:")
        for v, r in off:
            print(f"  {v.name} [{v.switches()}; tiers {','.join(v.tiers) or 'default'}]: loss "
                  f"{fmt(r.get('loss_err'))}, grad {fmt(r.get('grad_err'))} ({r.get('worst_grad')}), "
                  f"tolerance {r['tolerance']:.0e}; plain Inductor: loss {fmt(r.get('base_loss_err'))}, "
                  f"grad {fmt(r.get('base_grad_err'))}")
    warned = [(v, r) for v, r in results
              if r.get("chunk_failures") or r.get("warnings")]
    if warned:
        print("\nWarnings (strict mode should have none):")
        for v, r in warned:
            for w in r.get("chunk_failures", []) + r.get("warnings", []):
                print(f"  {v.name}: {w}")
    noticed = [(v, w) for v, r in results for w in r.get("notices", [])]
    if noticed:
        print("\nNotices (a rule not applied, and what the user's code can say to apply it; not errors):")
        for v, w in noticed:
            print(f"  {v.name}: {w}")

    refused = [(v, r) for v, r in results if r.get("refused")]
    if refused:
        print("\nChunk rules matched but refused (not errors; why the chunk did not fire):")
        for v, r in refused:
            for line in r["refused"][:4]:
                print(f"  {v.name}: {line}")

    compiled = sum(bool(r.get("compiled")) for _, r in results)
    strict = sum(bool(r.get("compiled") and r.get("strict")) for _, r in results)
    good = sum(bool(within(r)) for _, r in results)
    firings = sum(sum(r.get("fired", {}).values()) for _, r in results)
    ever = {k for _, r in results for k, n in r.get("fired", {}).items() if n}
    never = sorted(zoo.shipped_rule_names() - ever)
    if args.json:
        args.json.write_text(json.dumps([r for _, r in results], indent=1))
    torch_bugs = sum(bool(r.get("torch_error")) for _, r in results)
    if torch_bugs:
        print(f"\n({torch_bugs} of the failures fail with plain Inductor too: torch's, not remat's)")
    print(f"\n{len(results)} variants, {compiled} compiled ({strict} strict), {good} within 1e-4 "
          f"(bf16 2e-2, fp16 1e-3, or 2x plain Inductor's error), {firings} rule firings; rules never fired: "
          f"{', '.join(never) or 'none'}")


if __name__ == "__main__":
    main()
