"""The tensor-parallel process group and the collectives the sharded layers call.

One group per process (the process *is* one TP rank). Two channels share the ranks:

    tensor channel   all-reduce / all-gather of activations   NCCL on CUDA, gloo on CPU
    control channel  the per-step command broadcast from rank 0  always gloo (CPU objects)

On CPU both channels are the same gloo group. Layers never ask whether they run in parallel:
with no group set up (``tp == 1``) they are never replaced by the sharded layers at all, so
the single-process path calls none of these functions.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ['TPGroup', 'init_group', 'get_group', 'destroy_group', 'all_reduce', 'all_gather_last',
           'free_port']


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank: this process's rank in ``[0, size)``; rank 0 is the engine process.
        size: the number of ranks (``PytorchEngineConfig.tp``).
        device: where this rank's weights and caches live.
        control: the gloo process group used for command objects.
    """
    rank: int
    size: int
    device: torch.device
    control: object = None


_GROUP: TPGroup | None = None


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for the rendezvous)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _loopback_interface() -> str | None:
    """Name of the loopback network interface (``lo`` on Linux), or None if there is none."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return 'lo' if 'lo' in names else None


def init_group(rank: int, size: int, port: int, device: torch.device, timeout_s: float) -> TPGroup:
    """Join the group (every rank calls this with the same ``port`` and ``size``).

    The rendezvous listens on 127.0.0.1 only: all ranks run on this machine. (A ``tcp://``
    init method would not do: torch's TCPStore server then listens on every interface
    whatever host the URL names, so rank 0 binds the socket itself and hands it over.)

    Raises:
        RuntimeError: a process group already exists in this process (one TP engine per
            process), or the rendezvous timed out.
        OSError: rank 0 cannot bind 127.0.0.1:``port``.
    """
    global _GROUP
    if dist.is_initialized():
        raise RuntimeError('a torch.distributed process group already exists in this process: only one '
                           'tensor-parallel engine can run per process (close the other engine first)')
    backend = 'nccl' if device.type == 'cuda' else 'gloo'
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        listener = socket.create_server(('127.0.0.1', port), backlog=max(64, size))
        store = dist.TCPStore('127.0.0.1', port, size, is_master=True, timeout=timeout,
                              master_listen_fd=listener.detach())       # the store owns the socket now
    else:
        store = dist.TCPStore('127.0.0.1', port, size, is_master=False, timeout=timeout)
    # gloo's own pair sockets bind to whatever the hostname resolves to (a LAN address on many
    # machines) unless told an interface: all ranks are local, so use the loopback one
    if _loopback_interface() and 'GLOO_SOCKET_IFNAME' not in os.environ:
        os.environ['GLOO_SOCKET_IFNAME'] = _loopback_interface()
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend='gloo', timeout=timeout) if backend != 'gloo' else dist.group.WORLD
    _GROUP = TPGroup(rank, size, device, control)
    return _GROUP


def get_group() -> TPGroup:
    """The group of this process.

    Raises:
        RuntimeError: :func:`init_group` was not called.
    """
    if _GROUP is None:
        raise RuntimeError('tensor-parallel group is not initialised')
    return _GROUP


def destroy_group() -> None:
    """Leave the group (idempotent)."""
    global _GROUP
    _GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks in place (row-parallel layers' partial sums); returns ``x``."""
    dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x [..., n]`` along the last dim in rank order → ``[..., size*n]``.

    Every rank must pass the same shape (vocab-parallel logits are padded to equal widths).
    """
    group = get_group()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
