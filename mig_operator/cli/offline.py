"""The commands that need no cluster: ``catalog``, ``inspect``, ``plan`` and ``demo`` (profile tables,
a GPU backend's view, a trace replayed through the planner, and carried out on simulated GPUs)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import TYPE_CHECKING

from ..core.placement.profiles import CATALOG, get_model
from ..core.placement.trace import TRACE_EXAMPLE, TraceEvent, parse_trace, replay
from ..core.requests.quantities import clip_repr, clip_text
from ..gpu.protocol import GpuError
from .flags import EXIT_GPU_ERROR, UsageError
from .views import model_json, model_text, placement_note, plan_lines

if TYPE_CHECKING:
    from ..gpu.protocol import GpuBackend

# A trace is a few KiB; reading stops here, so `--trace /dev/zero` ends with an error, not a hang.
MAX_TRACE_BYTES = 16 * 2**20
# `plan --gpus`: a replay holds every GPU in memory and scans them per event.
MAX_PLAN_GPUS = 4096
SIM_EXAMPLE = "sim:h100-80gb"


def cmd_catalog(args: argparse.Namespace) -> int:
    models = [get_model(args.model)] if args.model else [CATALOG[name] for name in sorted(CATALOG)]
    if args.json:
        out = model_json(models[0]) if args.model else [model_json(m) for m in models]
        print(json.dumps(out, indent=2))
    else:
        print("\n\n".join(model_text(m) for m in models))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..gpu.inventory import describe, render_text

    try:
        backend = _open_backend(args.backend, args.state_file)
    except GpuError as exc:
        if args.backend != "nvml":
            raise
        # Most often: no NVIDIA driver on this machine. The simulator shows the same view.
        print(f"mig-operator: {exc}; without an NVIDIA GPU, try the simulator: "
              f"mig-operator inspect --backend {SIM_EXAMPLE}", file=sys.stderr)
        return EXIT_GPU_ERROR
    try:
        desc = describe(backend)
    finally:
        backend.close()
    print(json.dumps(desc, indent=2) if args.json else render_text(desc))
    return 0


def _read_trace(path: str) -> list[TraceEvent]:
    shown = clip_repr(path)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_TRACE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read trace {shown}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a path with a NUL byte
        raise UsageError(f"cannot read trace {shown}: {exc}") from None
    if len(raw) > MAX_TRACE_BYTES:
        raise UsageError(
            f"trace {shown} is larger than {MAX_TRACE_BYTES // 2**20} MiB; a trace is a JSON list of events, "
            f"e.g. {TRACE_EXAMPLE}"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UsageError(
            f"trace {shown} is not UTF-8 text (binary, or UTF-16?); save it as UTF-8 JSON, e.g. {TRACE_EXAMPLE}"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"trace {shown} is not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise UsageError(f"trace {shown} is nested too deeply to read; e.g. {TRACE_EXAMPLE}") from None
    except ValueError:
        # Python refuses to read an integer of more than 4300 digits.
        raise UsageError(f"trace {shown} holds a number too long to read; e.g. {TRACE_EXAMPLE}") from None
    return parse_trace(data)


def _gpu_count(text: str) -> int:
    """``--gpus``: a whole number from 1 to MAX_PLAN_GPUS."""
    # Checked as text: int() accepts ' 2', '2_0', full-width digits, and refuses 5000 digits.
    if re.fullmatch(r"[0-9]{1,9}", text, re.ASCII) is None or not 1 <= int(text) <= MAX_PLAN_GPUS:
        raise UsageError(
            f"--gpus {clip_text(text)} must be a whole number from 1 to {MAX_PLAN_GPUS}, e.g. --gpus 2"
        )
    return int(text)


def _open_backend(spec: str, state_file: str | None) -> GpuBackend:
    from ..gpu import open_backend

    try:
        return open_backend(spec, state_file=state_file)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cmd_plan(args: argparse.Namespace) -> int:
    model = get_model(args.gpu)
    if not model.mig_capable:
        raise UsageError(
            f"--gpu {model.name} ({model.product}) has no MIG; plan replays MIG decisions, e.g. --gpu h200-141gb"
        )
    gpus = _gpu_count(args.gpus)
    results = replay(_read_trace(args.trace), model, gpu_count=gpus, eager=args.eager).results
    if args.json:
        print(json.dumps(results))
        return 0
    for line in plan_lines(results):
        print(line)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Replay a trace on simulated GPUs: plan each request, carry it out through the GPU backend,
    keep released instances idle, then reopen the backend as a restarted agent would."""
    import contextlib
    import signal
    import tempfile

    events = _read_trace(args.trace)
    with contextlib.ExitStack() as stack:
        if args.state_file:
            state, where = args.state_file, args.state_file
        else:
            # Removed at exit, also when stopped by SIGTERM; --state-file keeps the state.
            previous = signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
            stack.callback(signal.signal, signal.SIGTERM, previous)
            state = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="mig-demo-")),
                                 "sim-state.json")
            where = "a temporary file, removed at exit (--state-file PATH keeps it)"
        return _demo(args, events, state, where)


def _demo(args: argparse.Namespace, events: list[TraceEvent], state: str, where: str) -> int:
    import time

    from ..core.placement.planner import Unplaceable
    from ..core.placement.planning_index import choose_mig
    from ..gpu.inventory import describe, render_text
    from ..kube.agent.direct import planner_view, realise_decision

    backend = _open_backend(args.backend, state)
    if not any(gpu.mig_enabled for gpu in backend.gpus()):
        backend.close()
        raise UsageError(
            f"backend {clip_text(args.backend)} has no GPU in MIG mode; demo plans MIG slices, "
            "e.g. --backend sim:h200-141gbx2"
        )
    print(f"== {len(backend.gpus())} simulated GPU(s) from {args.backend}; state in {where}")
    explained = False
    bound: dict[str, tuple[int, int]] = {}  # slice -> (gpu, GI id)
    for event in events:
        if event.op == "free":
            if bound.pop(event.id, None) is not None:
                print(f"{event.id}: released; its instance stays idle for the next request")
            continue
        assert event.request is not None
        gis = {gpu: {gi for g, gi in bound.values() if g == gpu} for gpu in range(len(backend.gpus()))}
        view = [planner_view(backend, i, gis[i]) for i in gis]
        try:
            decision = choose_mig(event.request, view)
        except Unplaceable as exc:
            print(f"{event.id}: {event.request.describe()} stays Pending: {exc.reason}")
            continue
        t0 = time.perf_counter()
        made = realise_decision(backend, decision)
        took = (time.perf_counter() - t0) * 1000
        reclaimed = "".join(f", reclaimed {r.profile}@{r.start}" for r in decision.reclaim)
        print(f"{event.id}: {event.request.describe()} -> {decision.action} {made.profile} on GPU {made.gpu_index} "
              f"at {{{made.start}}}:{made.size}{reclaimed}, {made.device_uuid} ({took:.1f} ms)")
        if not explained:
            slots = backend.model(made.gpu_index).memory_slots
            print(f"  {placement_note(made.start, made.size, slots)}")
            explained = True
        bound[event.id] = (made.gpu_index, made.gi_id)
    backend.close()
    restarted = _open_backend(args.backend, state)
    print("\n== after a restart the backend finds the instances it left:")
    print(render_text(describe(restarted)))
    restarted.close()
    return 0


def add_offline_commands(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--gpus", default="1", help=f"number of GPUs, 1 to {MAX_PLAN_GPUS} (default 1)")
    p.add_argument("--trace", required=True, help="JSON list of alloc/free events")
    p.add_argument("--eager", action="store_true", help="destroy instances when freed instead of keeping them idle")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("demo", help="plan and carry out a trace on simulated GPUs")
    p.add_argument("--backend", default="sim:h200-141gbx2", help="a simulator spec, e.g. sim:h100-80gbx4")
    p.add_argument("--trace", default="examples/trace-h200.json", help="JSON list of alloc/free events")
    p.add_argument("--state-file", help="simulator state file (default: a new temporary file)")
    p.set_defaults(func=cmd_demo)
