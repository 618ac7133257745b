# ruff: noqa: F821  (a fragment: os and torch come from the utils.py it is appended to)
# --- ep_dispatcher harness (appended by run_deepep_tests.sh to a copy of DeepEP's tests/utils.py) -------------------
# Only the harness changes; DeepEP's tests and assertions run as they are. Later definitions win, so the tests'
# `from utils import init_dist, bench_kineto` get these.
#  * init_dist: gloo (NCCL refuses several ranks on one GPU) and every rank on cuda:0; ranks run concurrently under
#    MPS. Same environment variables as DeepEP's (MASTER_ADDR, MASTER_PORT, WORLD_SIZE = nodes, RANK = node rank).
#  * gloo collectives on CUDA tensors are staged through host memory (gloo's CUDA support varies by collective), and
#    all_gather_into_tensor goes through a list all-gather (gloo refuses DeepEP's [world, n, k] output shape).
#  * bench_kineto times the whole fn with CUDA events instead of reading kernel names from a profile: every name gets
#    the full duration of fn (divided by num_kernels_per_period when periods are asked for). The bandwidths the
#    tests print from it are therefore lower bounds, not per-kernel figures.
import torch.distributed as _ep_dist


def init_dist(local_rank: int, num_local_ranks: int):
    ip = os.getenv("MASTER_ADDR", "127.0.0.1")
    port = int(os.getenv("MASTER_PORT", "8361"))
    num_nodes = int(os.getenv("WORLD_SIZE", 1))
    node_rank = int(os.getenv("RANK", 0))
    _ep_dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://{ip}:{port}",
        world_size=num_nodes * num_local_ranks,
        rank=node_rank * num_local_ranks + local_rank,
    )
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    torch.cuda.set_device(0)
    return _ep_dist.get_rank(), _ep_dist.get_world_size(), _ep_dist.new_group(list(range(num_local_ranks * num_nodes)))


def _ep_host_staged(collective, tensor_args):
    def staged(*args, **kwargs):
        args = list(args)
        cuda = [i for i in tensor_args if i < len(args) and _ep_is_cuda(args[i])]
        if not cuda:
            return collective(*args, **kwargs)
        originals = {i: args[i] for i in cuda}
        for i in cuda:
            args[i] = [t.cpu() for t in args[i]] if isinstance(args[i], list) else args[i].cpu()
        kwargs.pop("async_op", None)
        collective(*args, **kwargs)
        for i, original in originals.items():  # copy results back (outputs and in-place inputs)
            if isinstance(original, list):
                for dst, src in zip(original, args[i]):
                    dst.copy_(src)
            else:
                original.copy_(args[i])
        return None

    return staged


def _ep_is_cuda(value):
    if isinstance(value, list):
        return any(isinstance(t, torch.Tensor) and t.is_cuda for t in value)
    return isinstance(value, torch.Tensor) and value.is_cuda


_ep_all_gather = _ep_dist.all_gather


def _ep_all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    # gloo's all_gather_into_tensor wants a flat [world * n, ...] output; DeepEP's test passes [world, n, k]. The
    # same result through a list all-gather on the host.
    world = _ep_dist.get_world_size(group)
    parts = [torch.empty(input_tensor.shape, dtype=input_tensor.dtype, device="cpu") for _ in range(world)]
    _ep_all_gather(parts, input_tensor.cpu(), group=group)
    output_tensor.copy_(torch.stack(parts).view(output_tensor.shape))
    return None


_ep_dist.all_reduce = _ep_host_staged(_ep_dist.all_reduce, (0,))
_ep_dist.all_gather = _ep_host_staged(_ep_dist.all_gather, (0, 1))
_ep_dist.all_gather_into_tensor = _ep_all_gather_into_tensor


def bench_kineto(
    fn,
    kernel_names,
    num_tests: int = 30,
    suppress_kineto_output: bool = False,
    trace_path=None,
    barrier_comm_profiling: bool = False,
    num_kernels_per_period: int = 1,
):
    assert isinstance(kernel_names, (str, tuple))
    fn()  # warm-up
    torch.cuda.synchronize()
    if barrier_comm_profiling:
        _ep_dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_tests):
        fn()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / num_tests
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    per_name = [
        seconds if num_kernels_per_period == 1 else [seconds / num_kernels_per_period] * num_kernels_per_period
        for _ in names
    ]
    return per_name if isinstance(kernel_names, tuple) else per_name[0]
