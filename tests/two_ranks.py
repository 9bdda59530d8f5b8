"""Two ranks of one machine, and a free port for their rendezvous, for the tests that launch or check collectives
(imported by name: tests/ is on sys.path)."""

import socket


def free_port() -> int:
    """A localhost TCP port no process listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_two_ranks(fn) -> dict:
    """Run fn(rank, results) in two processes (torch.multiprocessing), each on GPU `rank` in an NCCL process group of
    both; returns `results`, the dict each rank writes what it found into."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_nccl_rank, args=(fn, free_port(), results), nprocs=2)
    return dict(results)


def _nccl_rank(rank: int, fn, port: int, results) -> None:
    """One spawned rank: its GPU, the process group's rendezvous at tcp://127.0.0.1:port, fn, and the group's end."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    try:
        fn(rank, results)
    finally:
        dist.destroy_process_group()
