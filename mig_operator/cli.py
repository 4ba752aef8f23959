"""`mig-operator`: the command line. It wires the layers; decisions live in core."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .core.profiles import CATALOG, CatalogError, GpuModel, get_model
from .core.quantities import QuantityError
from .core.trace import TraceError, parse_trace, replay

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def _model_json(model: GpuModel) -> dict:
    return {
        "model": model.name,
        "product": model.product,
        "memory_slots": model.memory_slots,
        "memory_mib": model.memory_mib,
        "profiles": [
            {
                "name": p.name,
                "id": p.id,
                "slices": p.slices,
                "memory_mib": p.memory_mib,
                "sm": p.sm,
                "max_instances": p.max_instances,
                "placements": [[pl.start, pl.size] for pl in p.placements],
            }
            for p in model.profiles
        ],
    }


def _model_text(model: GpuModel) -> str:
    lines = [f"{model.name} ({model.product}): {model.memory_slots} memory slots, {model.memory_mib} MiB"]
    lines.append(f"  {'profile':<14}{'id':>4}{'slices':>8}{'MiB':>8}{'SM':>6}{'max':>5}  placements")
    for p in model.profiles:
        starts = ",".join(str(pl.start) for pl in p.placements)
        lines.append(
            f"  {p.name:<14}{p.id:>4}{p.slices:>8}{p.memory_mib:>8}{p.sm:>6}{p.max_instances:>5}"
            f"  {{{starts}}}:{p.size}"
        )
    return "\n".join(lines)


def cmd_catalog(args: argparse.Namespace) -> int:
    models = [get_model(args.model)] if args.model else [CATALOG[name] for name in sorted(CATALOG)]
    if args.json:
        out = _model_json(models[0]) if args.model else [_model_json(m) for m in models]
        print(json.dumps(out, indent=2))
    else:
        print("\n\n".join(_model_text(m) for m in models))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from .gpu import open_backend
    from .gpu.inventory import describe, render_text
    from .gpu.protocol import GpuError

    try:
        backend = open_backend(args.backend, state_file=args.state_file)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        desc = describe(backend)
    except GpuError as exc:
        print(f"mig-operator: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.close()
    print(json.dumps(desc, indent=2) if args.json else render_text(desc))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    model = get_model(args.gpu)
    if args.gpus < 1:
        raise UsageError(f"--gpus {args.gpus} must be at least 1, e.g. --gpus 2")
    try:
        with open(args.trace, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise UsageError(f"cannot read trace {args.trace!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"trace {args.trace!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    results = replay(parse_trace(data), model, gpu_count=args.gpus, eager=args.eager).results
    if args.json:
        print(json.dumps(results))
        return 0
    for r in results:
        if "error" in r:
            print(f"{r['id']}: refused: {r['error']}")
            continue
        reclaimed = "".join(f" (reclaim {x['profile']}@{x['start']} on gpu {x['gpu']})" for x in r["reclaimed"])
        print(f"{r['id']}: {r['action']} {r['profile']} (id {r['profile_id']}) on gpu {r['gpu']} "
              f"at {{{r['start']}}}:{r['size']}{reclaimed}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mig-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("catalog", help="built-in MIG profile tables")
    p.add_argument("model", nargs="?", help=f"one of: {', '.join(sorted(CATALOG))}")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_catalog)

    p = sub.add_parser("inspect", help="GPUs, MIG mode, profiles, placements and instances")
    p.add_argument("--backend", default="nvml", help="nvml, or sim:MODEL[xN] such as sim:h200-141gbx2")
    p.add_argument("--state-file", help="simulator state file (kept between runs)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("plan", help="replay an allocation trace through the planner")
    p.add_argument("--gpu", required=True, help="GPU model, e.g. h200-141gb")
    p.add_argument("--gpus", type=int, default=1, help="number of GPUs (default 1)")
    p.add_argument("--trace", required=True, help="JSON list of alloc/free events")
    p.add_argument("--eager", action="store_true", help="destroy instances when freed instead of keeping them idle")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, CatalogError, TraceError, QuantityError) as exc:
        print(f"mig-operator: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
