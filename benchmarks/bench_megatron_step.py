"""Step time of a Megatron-core GPT-MoE training step with several MoE token dispatchers, same model, weights
(seeded) and data (the model and training step of examples/megatron_pretrain_moe.py).

Rows (``--rows``, comma separated; each row runs in its OWN processes: a child invocation of this script spawns the
ranks of one row, writes raw JSON, and the parent merges the rows, so the real ``deep_ep`` of row flex_deepep and the
``deep_ep`` switch of row flex_switch never share an interpreter):

    ours         (a) moe_token_dispatcher_type="deepep": our plugin (ep_dispatcher.megatron)
    ours_unfused (a') the plugin with fused_permute = False and the fused kernels off (separate permute passes)
    flex_deepep  (b) Megatron's flex dispatcher (moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=
                     "deepep", fused_a2a.py) on REAL DeepEP v1.2.1: the child gets --deepep-path first on PYTHONPATH
                     (on the device: .deepep/DeepEP built in place by .deepep/run_side_by_side.sh's build line); our
                     plugin is uninstalled in that process; the row refuses to run if ``deep_ep`` is not real DeepEP
    flex_switch  (c) the same flex dispatcher on ep_dispatcher through ep_dispatcher.install_as_deep_ep()
    allgather    Megatron's "allgather" dispatcher (on one GPU its collectives are staged through host memory)

    python benchmarks/bench_megatron_step.py --device cpu --ranks 2 --out /tmp/bench_megatron.json
    python benchmarks/bench_megatron_step.py --device cuda --ranks 4 --rows ours,flex_deepep,flex_switch \\
        --layers 1 --hidden 4096 --heads 8 --kv-channels 128 --moe-ffn 1024 --experts 64 --topk 8 --seq 1024 \\
        --tokens 4096 --dtype bf16 --out bench_megatron_4.json

A step is forward, backward, gradient all-reduce and Adam, timed on the wall clock with the device synchronised at
both ends; the table shows the median over --steps steps after --warmup, taking the slowest rank of each step.
"w/o AR" is the same step less the all-reduce of the dense gradients (timed between device syncs): with several
ranks on one GPU it goes through host memory (gloo), costs the same for every row and is most of the step.

MoE stage breakdown: every ``MoETokenDispatcher`` of the model (ours and Megatron's flex dispatcher implement the
same six stage methods, which ``MoELayer`` calls) is wrapped per instance (``StageTimer.wrap_model``):
``token_dispatch`` = dispatch, ``dispatch_postprocess`` = permute, ``combine_preprocess`` = unpermute,
``token_combine`` = combine. Forward: a CUDA event recorded on the current stream before and after the call (the
flex dispatcher's async work on its communication stream is joined to the current stream before the call returns).
Backward: a tensor hook on the stage's first differentiable output records an event when its gradient arrives
(the stage's backward starts), and a hook on its first differentiable input records one when the gradient w.r.t.
that input is complete (the stage's backward ends; a stage that returns its input unchanged, such as permute and
unpermute with our fused permute, has no backward and counts 0); these inputs have one consumer each in the layer
(no shared experts in this model), so the bracket holds that stage's backward and little else. On CPU the clock is
``time.perf_counter`` instead of events. Per step the per-layer times are summed; the table takes, per step, the
slowest rank, then the median over the timed steps. "moe" = dispatch + permute + unpermute + combine, forward +
backward.

Isolated stages (``--isolated-steps``, after the timed steps): when the step is host-bound (Megatron's SequentialMLP
launches a GEMM per local expert), the ranks drift apart by milliseconds, and the first collective after the expert
loop (forward combine, backward of combine = dispatch of the gradients) waits that drift out inside its kernel. In
the plain steps that wait lands in whichever stage comes first, for every dispatcher alike. In the isolated steps
every stage starts after ``torch.cuda.synchronize()`` and a ``dist.barrier()``, so its time is the dispatcher's own
cost (host launch + kernels). Their wall times are not in the step median.

Experts (``--expert-impl``): ``sequential`` is Megatron's SequentialMLP (the local spec's default, host-bound as
above); ``grouped`` is examples/torch_grouped_experts.py, every local expert in two ``torch._grouped_mm`` calls with
no host sync, standing in for Megatron's TransformerEngine grouped experts (``TEGroupedMLP``), which this project does
not rely on. With grouped experts the step is GPU-bound and the ranks stay in step, so the plain stage times are
the dispatchers' own. Same experts for every row.

Process group: NCCL with one GPU per rank; gloo on CPU and when several ranks share one GPU (NCCL refuses that).
gloo has no CUDA all_gather_into_tensor / reduce_scatter_tensor, which Megatron's allgather dispatcher calls, so in
that case this script stages those calls through host memory (see ``enable_host_staging``) and says so: that makes
the allgather baseline slower than it would be on NCCL. Rows ours / flex_deepep / flex_switch move tokens through
their own CUDA-IPC buffers and do not need the staging (DeepEP's Buffer bootstraps over the gloo group with
all_gather_object, which gloo does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from typing import Optional

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "examples")]  # run from a checkout; the example is the model

import megatron_pretrain_moe as example  # noqa: E402

from ep_dispatcher.launch import spawn  # noqa: E402

STAGED_COLLECTIVES = ("all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor", "_reduce_scatter_base")
staged_calls: Counter = Counter()  # per process: how many collectives went through the host


class _CompletedWork:
    """What an ``async_op=True`` caller gets from a staged collective: it already ran synchronously."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _host_staged(name: str, collective, always: bool):
    """``collective(output, input, ...)`` that, for CUDA tensors on a gloo group (any tensor if ``always``), copies
    the input to the host, runs there and copies the result back; anything else goes to ``collective`` unchanged."""

    def staged(output, input_, *args, group=None, async_op=False, **kwargs):
        if not (always or (output.is_cuda and dist.get_backend(group) == "gloo")):
            return collective(output, input_, *args, group=group, async_op=async_op, **kwargs)
        staged_calls[name] += 1
        host_output = torch.empty_like(output, device="cpu")
        collective(host_output, input_.cpu(), *args, group=group, **kwargs)
        output.copy_(host_output)
        return _CompletedWork() if async_op else None

    return staged


def enable_host_staging(always: bool = False) -> None:
    """Route ``STAGED_COLLECTIVES`` through ``_host_staged`` in this process: in ``torch.distributed`` (modules
    imported later pick them up) and in the megatron modules that already hold their own alias (e.g.
    ``tensor_parallel.mappings.dist_all_gather_func``). gloo does all-reduce / all-gather lists of CUDA tensors
    itself, so those stay as they are. ``always`` stages CPU tensors too (to test the shim on CPU)."""
    import megatron.core.tensor_parallel.mappings  # noqa: F401  (binds the aliases the allgather dispatcher calls)

    replacement = {}
    for name in STAGED_COLLECTIVES:
        original = getattr(dist, name)
        replacement[id(original)] = _host_staged(name, original, always)
        setattr(dist, name, replacement[id(original)])
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("megatron.") and module is not None:
            for attr, value in list(vars(module).items()):
                if id(value) in replacement:
                    setattr(module, attr, replacement[id(value)])


# ---------------------------------------------------------------------------------------------------- rows
ROWS = {
    "ours": '(a) ours: moe_token_dispatcher_type="deepep" (ep_dispatcher plugin)',
    "ours_unfused": "(a') ours with separate permute / un-permute passes (fused_permute = False, fused kernels off)",
    "flex_deepep": "(b) Megatron flex dispatcher on real DeepEP v1.2.1",
    "flex_switch": "(c) Megatron flex dispatcher on ep_dispatcher via install_as_deep_ep()",
    "allgather": "Megatron allgather dispatcher",
}
DISPATCHER_TYPE = {
    "ours": "deepep",
    "ours_unfused": "deepep",
    "flex_deepep": "flex",
    "flex_switch": "flex",
    "allgather": "allgather",
}
DEFAULT_DEEPEP_PATH = os.path.join(REPO, ".deepep", "DeepEP")
ROW_TIMEOUT_S = 900  # a row whose ranks hang is reported as failed instead of blocking the other rows

# ---------------------------------------------------------------------------------------------------- MoE stage timing
# Token-dispatcher stage methods -> the label they are reported under; MOE_STAGES sum to "moe".
STAGES = {
    "token_dispatch": "dispatch",
    "dispatch_postprocess": "permute",
    "combine_preprocess": "unpermute",
    "token_combine": "combine",
}
MOE_STAGES = tuple(STAGES.values())


def _first_grad_tensor(obj):
    """The first tensor that requires grad in ``obj`` (a tensor, or a tuple/list of them and other values)."""
    items = obj if isinstance(obj, (tuple, list)) else (obj,)
    for item in items:
        if isinstance(item, torch.Tensor) and item.requires_grad:
            return item
    return None


class StageTimer:
    """Forward and backward time of each token-dispatcher stage, per step (see the module docstring)."""

    def __init__(self, device: torch.device, isolate_from: Optional[int] = None) -> None:
        self.device = device
        self.isolate_from = isolate_from  # steps from this index on are isolated (see _stamp)
        self.isolate = isolate_from == 0
        self.calls: list[dict] = []  # this step's calls: {"stage", "fwd": [t0, t1], "bwd": [t0, t1]}
        self.per_step: list[dict] = []  # per step: {label: {"fwd": ms, "bwd": ms}}

    def _stamp(self, starts: bool = False):
        if starts and self.isolate:
            # Isolated step: a stage starts with the device idle and every rank at the same point, so its time is
            # what the dispatcher costs (host launch + kernels), not the wait for a peer that is still busy with the
            # host-bound expert loop before it (the skew a plain step's first collective absorbs).
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dist.barrier()
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed_ms(self, start, end) -> float:
        if start is None or end is None:
            return 0.0
        if self.device.type == "cuda":
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def _wrap(self, label: str, method):
        def timed(*args, **kwargs):
            call = {"stage": label, "fwd": [None, None], "bwd": [None, None]}
            self.calls.append(call)
            grad_in = _first_grad_tensor(args)
            if grad_in is None:
                grad_in = _first_grad_tensor(tuple(kwargs.values()))

            def backward_ends(grad) -> None:
                if call["bwd"][0] is not None:  # only once the stage's backward started (a hook returns None)
                    call["bwd"][1] = self._stamp()

            if grad_in is not None:
                grad_in.register_hook(backward_ends)
            call["fwd"][0] = self._stamp(starts=True)
            out = method(*args, **kwargs)
            call["fwd"][1] = self._stamp()
            grad_out = _first_grad_tensor(out)
            if grad_out is grad_in:  # the stage passes its input through (e.g. a fused permute): no backward
                call["bwd"] = [None, None]
            elif grad_out is not None:

                def backward_starts(grad) -> None:
                    call["bwd"][0] = self._stamp(starts=True)

                grad_out.register_hook(backward_starts)
            return out

        return timed

    def wrap_model(self, model) -> int:
        """Wrap the stage methods of every MoE layer's token dispatcher (instance attributes; classes untouched)."""
        wrapped = 0
        for module in model.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is None or getattr(dispatcher, "_stage_timer_wrapped", False):
                continue
            for name, label in STAGES.items():
                setattr(dispatcher, name, self._wrap(label, getattr(dispatcher, name)))
            dispatcher._stage_timer_wrapped = True
            wrapped += 1
        if wrapped == 0:
            raise RuntimeError("StageTimer: the model has no MoE layer with a token_dispatcher")
        return wrapped

    def end_step(self, step: int) -> None:
        """After the step's device sync: turn this step's stamps into milliseconds per label."""
        totals = {label: {"fwd": 0.0, "bwd": 0.0} for label in MOE_STAGES}
        for call in self.calls:
            for phase in ("fwd", "bwd"):
                totals[call["stage"]][phase] += self._elapsed_ms(*call[phase])
        self.per_step.append(totals)
        self.calls = []
        self.isolate = self.isolate_from is not None and step + 1 >= self.isolate_from


# ---------------------------------------------------------------------------------------------------- one row
def _rank_device(rank: int, args) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())  # one GPU: every rank on cuda:0
    torch.cuda.set_device(device)
    return device


def _buffer_info(row: str) -> dict:
    """Which communication buffer the row's layers used."""
    if row in ("flex_deepep", "flex_switch"):
        from megatron.core.transformer.moe import fused_a2a

        buf = fused_a2a._buffer
        info = {"buffer_type": f"{type(buf).__module__}.{type(buf).__name__}" if buf is not None else None}
        if row == "flex_switch" and buf is not None:
            info.update(backend=buf.backend, engine_calls=list(buf.engine_calls))
        return info
    from ep_dispatcher.megatron import buffer_cache

    buffers = list(buffer_cache.cache.buffers.values())  # the Buffer the "deepep" layers used (one per group)
    if not buffers:
        return {"backend": None, "engine_calls": []}
    return {"backend": buffers[0].backend, "engine_calls": list(buffers[0].engine_calls)}


def _check_deep_ep(row: str) -> str:
    """Row flex_deepep must see the real DeepEP, row flex_switch ours; returns where ``deep_ep`` comes from."""
    from megatron.core.transformer.moe import fused_a2a

    if not fused_a2a.HAVE_DEEP_EP:
        raise RuntimeError(
            f"row {row}: megatron-core could not import deep_ep (fused_a2a.HAVE_DEEP_EP is False); for flex_deepep "
            "build DeepEP v1.2.1 in --deepep-path (cd .deepep/DeepEP && DEEPEP_FORCE_NO_NVSHMEM=1 "
            "TORCH_CUDA_ARCH_LIST=9.0 python3 setup.py build_ext --inplace)"
        )
    import deep_ep

    is_ours = deep_ep.__name__ == "ep_dispatcher"
    if row == "flex_deepep" and is_ours:
        raise RuntimeError("row flex_deepep: deep_ep resolved to ep_dispatcher, expected the real DeepEP")
    if row == "flex_switch" and not is_ours:
        raise RuntimeError(f"row flex_switch: deep_ep is {deep_ep.__file__}, expected ep_dispatcher (the switch)")
    return str(getattr(deep_ep, "__file__", deep_ep))


def _single_node_rdma_hint_shim() -> bool:
    """Row flex_deepep's one harness shim (no Megatron source is changed).

    Megatron's ``fused_a2a.get_buffer`` sizes the buffer with ``config.get_rdma_buffer_size_hint(hidden_bytes, R)``.
    A DeepEP built without NVSHMEM (``DEEPEP_FORCE_NO_NVSHMEM=1``: this machine has no NIC, and the side-by-side
    builds it so) asserts "NVSHMEM is disable during compilation" there, whereas a DeepEP built with NVSHMEM returns 0
    for R <= 8 (intranode: no RDMA buffer). The shim gives ``fused_a2a`` a stand-in for ``Buffer`` whose
    dispatch/combine configs answer that 0 for R <= 8 and defer everything else to DeepEP; it is installed only when
    the hint raises.
    Returns whether it was installed."""
    from megatron.core.transformer.moe import fused_a2a

    real = fused_a2a.Buffer
    try:
        real.get_dispatch_config(2).get_rdma_buffer_size_hint(1024, 2)
        return False
    except Exception:  # DeepEP's EP_HOST_ASSERT surfaces as RuntimeError (or its own exception type)
        pass

    class _Config:
        def __init__(self, config) -> None:
            self._config = config

        def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
            return self._config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)

        def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
            if num_ranks > 8:
                raise RuntimeError("flex_deepep shim: DeepEP without NVSHMEM cannot size an internode buffer")
            return 0  # what DeepEP's NVSHMEM build returns for one node

    class SingleNodeBuffers:
        """Stands for ``deep_ep.Buffer`` in ``fused_a2a`` only: the configs it sizes with answer the hint; buffers
        it builds are real ``deep_ep.Buffer`` objects (whose own calls still get DeepEP's real configs)."""

        def __call__(self, *args, **kwargs):
            return real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

        def get_dispatch_config(self, num_ranks):
            return _Config(real.get_dispatch_config(num_ranks))

        def get_combine_config(self, num_ranks):
            return _Config(real.get_combine_config(num_ranks))

    fused_a2a.Buffer = SingleNodeBuffers()
    return True


def _profile_one_step(on_step, warmup: int, path: str):
    """``on_step`` plus a torch.profiler record of step ``warmup`` (the first timed step) on this rank, written to
    ``path`` as the CUDA-time table (kernels and ops, top 40): where the step's GPU time goes, per row."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def step_done(step: int) -> None:
        on_step(step)
        if step == warmup - 1:
            prof.start()
        elif step == warmup:
            prof.stop()
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))

    return step_done


def _worker(rank: int, world: int, args) -> dict:
    warnings.filterwarnings("ignore")
    row = args.row_worker
    if row == "flex_switch":
        import ep_dispatcher

        ep_dispatcher.install_as_deep_ep()  # before megatron-core imports deep_ep
    from megatron.core import parallel_state

    if row == "ours_unfused":  # the plugin's path before the fused permute (docs/fused_permute.md)
        os.environ["EP_DISPATCHER_FUSED_EXPERT_MAJOR"] = "0"
        from ep_dispatcher.megatron.token_dispatcher import EPDispatcherTokenDispatcher

        EPDispatcherTokenDispatcher.fused_permute = False
    device = _rank_device(rank, args)
    shim = args.host_staging == "always" or (
        args.host_staging == "auto" and device.type == "cuda" and dist.get_backend() == "gloo"
    )
    if shim:
        enable_host_staging(always=args.host_staging == "always")
    example.setup_parallel(world, args, device)  # installs our plugin (registers "deepep")
    deep_ep_from = None
    rdma_hint_shim = False
    if row in ("flex_deepep", "flex_switch"):
        from ep_dispatcher import megatron as plugin

        plugin.uninstall()  # "flex" must reach Megatron's own flex dispatcher, not our plugin
        deep_ep_from = _check_deep_ep(row)
        if row == "flex_deepep":
            rdma_hint_shim = _single_node_rdma_hint_shim()
    run_args = argparse.Namespace(**{**vars(args), "steps": args.warmup + args.steps + args.isolated_steps})
    timer = StageTimer(device, isolate_from=args.warmup + args.steps)
    on_step = timer.end_step
    if args.profile_dir and rank == 0:
        on_step = _profile_one_step(timer.end_step, args.warmup, os.path.join(args.profile_dir, f"profile_{row}.txt"))
    staged_calls.clear()
    step_s: list[float] = []
    allreduce_s: list[float] = []
    losses = example.train(
        run_args,
        DISPATCHER_TYPE[row],
        rank,
        device,
        step_s,
        on_model=timer.wrap_model,
        on_step=on_step,
        allreduce_times=allreduce_s,
    )
    result = {
        "device": str(device),
        "pg": dist.get_backend(),
        "shim": shim,
        "losses": losses,
        "step_s": step_s,
        "allreduce_s": allreduce_s,
        "stages": timer.per_step,
        "staged_calls": dict(staged_calls),
        "buffer": _buffer_info(row),
        "deep_ep": deep_ep_from,
        "rdma_hint_shim": rdma_hint_shim,
    }
    if device.type == "cuda":
        result["max_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    parallel_state.destroy_model_parallel()
    return result


def _run_row_here(args) -> int:
    """Child mode (``--row-worker ROW --raw-out PATH``): spawn the ranks of one row, write their raw results."""
    pg_backend = example.process_group_backend(args)
    results = spawn(_worker, args.ranks, args, backend=pg_backend)
    with open(args.raw_out, "w") as f:
        json.dump(results, f)
    return 0


def _run_row_child(row: str, argv: list[str], args, workdir: str) -> dict:
    """Run one row in a child invocation of this script; returns ``{"ranks": [...]}`` or ``{"error": ...}``."""
    raw = os.path.join(workdir, f"{row}.json")
    command = [sys.executable, os.path.abspath(__file__), *argv, "--row-worker", row, "--raw-out", raw]
    env = dict(os.environ)
    if row == "flex_deepep":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.deepep_path, env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, cwd=REPO, timeout=args.row_timeout, check=False)
        returncode = done.returncode
    except subprocess.TimeoutExpired:
        returncode = "timeout"
    wall_s = time.perf_counter() - start
    if returncode != 0 or not os.path.exists(raw):
        return {"error": f"row {row}: child exited with {returncode} after {wall_s:.0f} s (see its output above)"}
    with open(raw) as f:
        return {"ranks": json.load(f), "wall_s": wall_s}


# ---------------------------------------------------------------------------------------------------- summary
def _median_of_slowest(per_rank: list[list[float]], warmup: int) -> float:
    slowest = [max(values[i] for values in per_rank) for i in range(len(per_rank[0]))]
    return statistics.median(slowest[warmup:])


def _stage_medians(ranks: list[dict], steps: slice) -> tuple[float, dict]:
    """(MoE ms, {label: {"fwd", "bwd"}}): per step the slowest rank, then the median over ``steps``."""
    stages = {
        label: {
            phase: _median_of_slowest([[s[label][phase] for s in r["stages"][steps]] for r in ranks], 0)
            for phase in ("fwd", "bwd")
        }
        for label in MOE_STAGES
    }
    moe_per_rank = [
        [sum(s[label][p] for label in MOE_STAGES for p in ("fwd", "bwd")) for s in r["stages"][steps]] for r in ranks
    ]
    return _median_of_slowest(moe_per_rank, 0), stages


def _summarise_row(args, ranks: list[dict]) -> dict:
    r0 = ranks[0]
    num_steps = args.warmup + args.steps
    slowest = [max(r["step_s"][i] for r in ranks) for i in range(num_steps)]
    median_s = statistics.median(slowest[args.warmup :])
    # The step without the dense gradients' all-reduce: on one GPU that goes through host memory (gloo), costs the
    # same for every row and dominates the step; per step the slowest rank of (step - all-reduce).
    compute_ms = 1e3 * _median_of_slowest(
        [[t - a for t, a in zip(r["step_s"], r["allreduce_s"])][:num_steps] for r in ranks], args.warmup
    )
    moe_ms, stages = _stage_medians(ranks, slice(args.warmup, num_steps))
    isolated = {}
    if args.isolated_steps > 0:
        moe_isolated_ms, stages_isolated = _stage_medians(ranks, slice(num_steps, None))
        isolated = {"moe_isolated_ms": moe_isolated_ms, "stages_isolated_ms": stages_isolated}
    return {
        "median_step_ms": median_s * 1e3,
        "tokens_per_s": args.ranks * args.tokens / median_s,
        "step_ms": [t * 1e3 for t in slowest],
        "median_step_without_allreduce_ms": compute_ms,
        "moe_ms": moe_ms,
        "stages_ms": stages,
        **isolated,
        "losses": r0["losses"],
        "staged_calls_per_step": {op: n / num_steps for op, n in r0["staged_calls"].items()},
        "buffer": r0["buffer"],
        "deep_ep": r0["deep_ep"],
        "max_memory_gb": max(r.get("max_memory_gb", 0.0) for r in ranks),
    }


def _summarise(args, rows: dict) -> dict:
    """Per row: median over timed steps of the slowest rank's step / MoE time; losses compared with the first row."""
    first_ok = next((r for r in rows.values() if "ranks" in r), None)
    summary: dict = {"args": vars(args), "rows": list(rows), "tokens_per_step": args.ranks * args.tokens}
    if first_ok is not None:
        r0 = first_ok["ranks"][0]
        summary.update(process_group=r0["pg"], host_staging=r0["shim"])
        summary["devices"] = sorted({r["device"] for r in first_ok["ranks"]})
    summary["dispatchers"] = {}
    for name, row in rows.items():
        if "error" in row:
            summary["dispatchers"][name] = {"error": row["error"]}
        else:
            summary["dispatchers"][name] = {**_summarise_row(args, row["ranks"]), "wall_s": row["wall_s"]}
    summary["tolerance"] = example.tolerance(args)
    ref_name = next(iter(rows))
    ref = summary["dispatchers"][ref_name]
    summary["loss_reference"] = ref_name
    summary["max_loss_diff"] = 0.0
    summary["ratios_vs_reference"] = {}
    for name, d in summary["dispatchers"].items():
        if name == ref_name or "error" in d or "error" in ref:
            continue
        d["loss_diff_per_step"] = [abs(a - b) for a, b in zip(ref["losses"], d["losses"])]
        d["max_loss_diff"] = max(d["loss_diff_per_step"])
        summary["max_loss_diff"] = max(summary["max_loss_diff"], d["max_loss_diff"])
        summary["ratios_vs_reference"][name] = {
            "step": d["median_step_ms"] / ref["median_step_ms"],
            "step_without_allreduce": d["median_step_without_allreduce_ms"] / ref["median_step_without_allreduce_ms"],
            "moe": d["moe_ms"] / ref["moe_ms"] if ref["moe_ms"] > 0 else None,
        }
        if ref.get("moe_isolated_ms"):
            summary["ratios_vs_reference"][name]["moe_isolated"] = d["moe_isolated_ms"] / ref["moe_isolated_ms"]
    errors = [n for n, d in summary["dispatchers"].items() if "error" in d]
    summary["errors"] = errors
    summary["ok"] = not errors and summary["max_loss_diff"] <= summary["tolerance"]
    return summary


def _print(args, s: dict) -> None:
    print(
        f"bench_megatron_step: GPT-MoE training step, {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
        f"of {args.kv_channels or args.hidden // args.heads} channels, moe ffn "
        f"{args.moe_ffn or args.hidden}, {args.experts} experts top-{args.topk}, EP={args.ranks}, {args.tokens} "
        f"tokens/rank (seq {args.seq} x {args.batch}), {args.dtype}; {args.ranks} ranks on "
        f"{', '.join(s.get('devices', ['?']))}, {s.get('process_group', '?')} process group; each row in its own "
        "processes"
    )
    if s.get("host_staging") and "allgather" in s["dispatchers"]:
        print("  allgather: its all-gathers/reduce-scatters are STAGED THROUGH HOST MEMORY (gloo): slower than on NCCL")
    if args.device == "cpu":
        print("  CPU run: collectives are gloo on host tensors; CPU timings say nothing about GPUs")
    print(
        f"  step = forward + backward + gradient all-reduce + Adam; median of {args.steps} steps after {args.warmup} "
        "warm-up, slowest rank per step; 'w/o AR' = the step less the dense gradients' all-reduce (through host "
        "memory on one GPU, the same for every row); stage times (ms, fwd/bwd) by events around the token "
        "dispatcher's methods"
    )
    header = f"  {'row':12s} {'step ms':>9s} {'w/o AR':>8s} {'moe ms':>8s}"
    for label in MOE_STAGES:
        header += f" {label + ' f/b':>16s}"
    print(header)
    for name, d in s["dispatchers"].items():
        if "error" in d:
            print(f"  {name:12s} FAILED: {d['error']}")
            continue
        line = (
            f"  {name:12s} {d['median_step_ms']:9.2f} {d['median_step_without_allreduce_ms']:8.2f} {d['moe_ms']:8.2f}"
        )
        for label in MOE_STAGES:
            st = d["stages_ms"][label]
            line += f" {st['fwd']:7.2f}/{st['bwd']:<8.2f}"
        print(line)
    if args.isolated_steps > 0:
        print(
            f"  isolated MoE stages: median of {args.isolated_steps} more steps in which every stage starts with the "
            "device synchronised and the ranks at a barrier (the dispatcher's own cost, without the peer skew a "
            "plain step's collectives absorb; these steps' wall times are not in 'step ms')"
        )
        for name, d in s["dispatchers"].items():
            if "error" in d:
                continue
            line = f"  {name:12s} {'':>9s} {'':>8s} {d['moe_isolated_ms']:8.2f}"
            for label in MOE_STAGES:
                st = d["stages_isolated_ms"][label]
                line += f" {st['fwd']:7.2f}/{st['bwd']:<8.2f}"
            print(line)
    for name, d in s["dispatchers"].items():
        print(
            f"  {name:12s} = {ROWS[name]}; buffer {d.get('buffer')}"
            + (f"; deep_ep {d['deep_ep']}" if d.get("deep_ep") else "")
        )
    for name, ratio in s["ratios_vs_reference"].items():
        moe = f"{ratio['moe']:.2f}x" if ratio["moe"] is not None else "-"
        isolated = f", moe isolated {ratio['moe_isolated']:.2f}x" if "moe_isolated" in ratio else ""
        print(
            f"  {name} / {s['loss_reference']}: step {ratio['step']:.2f}x, step w/o AR "
            f"{ratio['step_without_allreduce']:.2f}x, moe {moe}{isolated}"
        )
    names = [n for n, d in s["dispatchers"].items() if "error" not in d]
    if names:
        print("  losses per step: " + "  ".join(f"{n:>12s}" for n in names))
        for step in range(len(s["dispatchers"][names[0]]["losses"])):
            print(f"  {step:>15d}: " + "  ".join(f"{s['dispatchers'][n]['losses'][step]:12.6f}" for n in names))
    print(
        f"  max |loss - loss {s['loss_reference']}| over rows and steps: {s['max_loss_diff']:.3e} "
        f"(tolerance {s['tolerance']:.1e}) -> {'OK' if s['ok'] else 'MISMATCH or FAILED ROW'}"
    )


def _child_argv(argv: list[str]) -> list[str]:
    """The parent's options minus those only the parent uses (--rows, --flex-switch, --out)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item in ("--rows", "--out"):
            skip = True
            continue
        if item == "--flex-switch" or item.startswith(("--rows=", "--out=")):
            continue
        out.append(item)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Every option of the example (shapes, --seq, --dtype, --backend = process group, ...) plus the timing ones.
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], parents=[example.build_parser()], conflict_handler="resolve"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--isolated-steps",
        type=int,
        default=3,
        help="steps after the timed ones in which every MoE stage starts synchronised and behind a barrier "
        "(the 'isolated' stage breakdown); 0 = none",
    )
    parser.add_argument(
        "--tokens", type=int, default=64, help="tokens per rank per step = --seq x micro-batch (sets --batch)"
    )
    parser.add_argument("--moe-ffn", type=int, default=None, help="expert FFN hidden size (default: --hidden)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--rows",
        default=None,
        help=f"comma-separated rows, each in its own processes, the first is the loss reference: {', '.join(ROWS)} "
        "(default ours,allgather; with --flex-switch ours,flex_switch)",
    )
    parser.add_argument(
        "--flex-switch", action="store_true", help="same as --rows ours,flex_switch (kept for old commands)"
    )
    parser.add_argument(
        "--deepep-path",
        default=DEFAULT_DEEPEP_PATH,
        help="directory holding the built real DeepEP package (put first on PYTHONPATH for row flex_deepep)",
    )
    parser.add_argument("--row-timeout", type=float, default=ROW_TIMEOUT_S, help="seconds per row")
    parser.add_argument(
        "--profile-dir", default=None, help="rank 0 of each row writes a profiler table of its first timed step here"
    )
    parser.add_argument(
        "--host-staging",
        choices=("auto", "always", "never"),
        default="auto",
        help="stage all_gather_into_tensor/reduce_scatter_tensor through host memory: auto = for CUDA tensors on "
        "gloo (one GPU, several ranks); always = on CPU too (tests the shim); never = leave them to gloo",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--row-worker", choices=tuple(ROWS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--raw-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    example.check_args(parser, args)
    args.flex_switch = False  # the example's own meaning (a second run in the same processes) is not used here
    if args.tokens % args.seq != 0:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --seq ({args.seq})")
    args.batch = args.tokens // args.seq
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.device == "cpu":
        # Megatron's CPU patches apply only when no GPU is visible (the ranks inherit this environment).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        args.backend = "gloo"
    pg_backend = example.process_group_backend(args)
    if args.host_staging == "always" and pg_backend != "gloo":
        parser.error(f"--host-staging always needs a gloo process group, got {pg_backend}")
    if args.row_worker is not None:
        if args.raw_out is None:
            parser.error("--row-worker needs --raw-out")
        return _run_row_here(args)

    flex_switch = "--flex-switch" in argv
    rows = [r.strip() for r in (args.rows or ("ours,flex_switch" if flex_switch else "ours,allgather")).split(",")]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows or len(set(rows)) != len(rows):
        parser.error(f"--rows: expected distinct names from {', '.join(ROWS)}, got {args.rows!r}")
    if "flex_deepep" in rows and args.device == "cpu":
        parser.error("--rows flex_deepep: real DeepEP runs on GPUs only (use --device cuda)")
    args.rows = ",".join(rows)
    child_argv = _child_argv(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_megatron_") as workdir:
        for row in rows:
            print(f"=== row {row}: {ROWS[row]}", flush=True)
            results[row] = _run_row_child(row, child_argv, args, workdir)
    summary = _summarise(args, results)
    _print(args, summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
