"""Data-parallel training over `torch.distributed`: joining the process group, the gradient
all-reduce (DDP), the loop's small host-side reductions, and naming a lost rank.

    dist = Dist.from_env(cfg.distributed, device)   # torchrun / accelerate launch (WORLD_SIZE in the environment)
    dist = Dist.single(accumulation)                # plain `python -m train`: one process, no group
    module = dist.wrap(drafter)                     # DDP whose all-reduce *sums* gradients
    with dist.grad_sync(last_micro_step): loss.backward()
    dist.sum([...]); dist.gather([...]); dist.broadcast(obj); dist.gather_objects(obj)

How a step is spread (docs/ARCHITECTURE.md, "Data parallel"): there is one global plan of batches
(`train.buckets`); a global batch is one optimizer step of `data.token_budget` padded tokens,
dealt by tokens into `world_size x accumulation` parts (`buckets.RankSplit`,
`buckets.split_by_tokens`). Anchors are drawn per row of the global batch and every part's loss is
normalized by the global batch's loss weight, so the parts' gradients add up to the gradient of
the global batch: DDP's all-reduce must sum, not average (`_allreduce_sum`).

Why DDP and not FSDP2: the 27B drafter's trainable state is 1.81 B parameters x 16 bytes (fp32
weights 7.2 GB, gradients 7.2 GB, AdamW moments 14.5 GB: ~29 GB); with the frozen embedding and
lm_head (2 x 2.5 GB bf16) and the activations of one 6,144-token micro-batch, every rank fits a full
replica on a 96 GB GPU with room to spare (the measured peaks, the plain trainer's and DDP's:
docs/benchmarks-log-2026-11-30-to-2026-12-04.md, "Training" and "Training on several GPUs"). DDP keeps the
single-GPU step as it is: gradients are views into its 250 MiB buckets (no second copy, though the 7.2 GB of
buckets stay allocated between steps where the plain trainer frees its gradients), and it moves 2 x 4 bytes per
parameter per step in one all-reduce overlapped with the backward (`distributed.ddp_compile =
outer`: Dynamo cuts the compiled graph at the buckets). FSDP2 would shard the ~29 GB of model state
but adds an all-gather of every layer's weights before its forward and again before its backward
(three collectives instead of one, two of them in the way of compute), sharded checkpoints and
optimizer state, for memory the run does not need. If a wider drafter stops fitting, FSDP2 is the
next step.

Faults: every collective has a timeout (`distributed.timeout_s`); a collective that fails (a peer
died: gloo sees the connection drop at once; or the timeout) becomes `PeerLost`, whose message
names the rank that is gone (`diagnose`: peers on this machine by process id, the others by who
answers on the rendezvous store within a few seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import json
import logging
import os
import socket
import time
from pathlib import Path

import numpy as np
import torch

from train.buckets import RankSplit

__all__ = ["Dist", "PeerLost", "launched_distributed"]

log = logging.getLogger(__name__)

# Substrings of the RuntimeErrors gloo and NCCL raise when a peer is gone or a collective timed out
# (older torch raises plain RuntimeError, newer torch.distributed.DistError).
_COMM_ERROR_HINTS = (
    "gloo",
    "nccl",
    "connection reset",
    "connection closed",
    "connection refused",
    "timed out",
    "timeout",
    "socket",
    "broken pipe",
    "peer",
)


class PeerLost(RuntimeError):
    """A collective failed: another rank died, hung or became unreachable. The message names it."""


def launched_distributed() -> bool:
    """Whether this process was started by torchrun / accelerate launch (or with RANK and WORLD_SIZE set)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _host_id() -> str:
    """This machine: host name plus the kernel boot id (containers on one host share it, other hosts do not)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _pid_gone(pid: int) -> bool:
    """True if process `pid` no longer runs on this machine (exited, or a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def _allreduce_sum(group, bucket):
    """DDP comm hook: sum the bucket over ranks (the default hook averages)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@dataclasses.dataclass
class Dist:
    """This process's place in a data-parallel run; world size 1 without a process group is the plain trainer."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    accumulation: int = 1
    device: torch.device | None = None  # this rank's device (cuda:LOCAL_RANK), None = the caller's choice
    backend: str | None = None  # None: no process group
    timeout_s: float = 600.0
    bucket_mb: int = 250
    peers: list[dict] = dataclasses.field(default_factory=list)  # per rank: host, pid, local_rank, device
    host_group: object = None  # gloo group for the host-side reductions
    _ddp: object = None

    # -- setup --------------------------------------------------------------------------------

    @classmethod
    def single(cls, accumulation: int = 1) -> Dist:
        return cls(accumulation=accumulation, peers=[cls._me(0, 0, None)])

    @classmethod
    def from_env(cls, cfg, device: torch.device) -> Dist:
        """Join the process group torchrun / accelerate launch describe in the environment, or
        return `single` when the process was started plainly. `cfg` is the `distributed` table."""
        if not launched_distributed():
            return cls.single(cfg.accumulation)
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
        if "MASTER_ADDR" not in os.environ:
            if world == 1:  # a scheduler that sets RANK=0 WORLD_SIZE=1 for every job: a plain run
                return cls.single(cfg.accumulation)
            raise ValueError(
                "RANK and WORLD_SIZE are set but MASTER_ADDR is not: start the run with torchrun or accelerate launch"
            )
        if device.type == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} GPU(s): "
                    "start at most one process per GPU (--nproc-per-node)"
                )
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and device.type != "cuda":
            raise ValueError("config key 'distributed.backend': nccl needs CUDA devices; use gloo (or auto) on CPU")
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
        host_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        me = cls._me(rank, local_rank, device)
        peers: list = [None] * world
        dist.all_gather_object(peers, me, group=host_group)
        return cls(
            rank=rank,
            world_size=world,
            local_rank=local_rank,
            accumulation=cfg.accumulation,
            device=device,
            backend=backend,
            timeout_s=cfg.timeout_s,
            bucket_mb=cfg.bucket_mb,
            peers=peers,
            host_group=host_group,
        )

    @staticmethod
    def _me(rank: int, local_rank: int, device) -> dict:
        return {
            "rank": rank,
            "local_rank": local_rank,
            "host": socket.gethostname(),
            "host_id": _host_id(),
            "pid": os.getpid(),
            "device": str(device) if device is not None else None,
        }

    @property
    def initialized(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def split(self) -> RankSplit:
        return RankSplit.of(self.rank, self.world_size, self.accumulation)

    @property
    def num_parts(self) -> int:
        return self.world_size * self.accumulation

    def describe(self) -> dict:
        """What run.json records about the layout of this run."""
        return {
            "world_size": self.world_size,
            "accumulation": self.accumulation,
            "parts_per_step": self.num_parts,
            "backend": self.backend,
            "timeout_s": self.timeout_s if self.initialized else None,
            "ranks": [
                {k: v for k, v in peer.items() if k != "host_id"}
                | {"parts": list(RankSplit.of(peer["rank"], self.world_size, self.accumulation).mine)}
                for peer in self.peers
            ],
        }

    def close(self) -> None:
        """Leave the process group once every rank is done with it.

        The barrier keeps one rank from tearing its connections down while a peer still has a
        collective (or a DDP hook's callback) in flight; dropping the DDP wrapper first lets its
        reducer release the group before the group is destroyed. Without both, a rank aborted at
        exit now and then (`terminate called without an active exception`) after a complete run."""
        if self.initialized:
            import gc

            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier(group=self.host_group)
                self._ddp = None
                gc.collect()
                dist.destroy_process_group()
            self.backend = None

    # -- gradients ----------------------------------------------------------------------------

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """`module` in DistributedDataParallel with a summing all-reduce (itself when there is no group)."""
        if not self.initialized:
            return module
        from torch.nn.parallel import DistributedDataParallel

        # The drafter's only buffer (rotary inv_freq) is a constant: no need to broadcast it every forward.
        no_buffer_sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else {"broadcast_buffers": False}
        )  # torch < 2.13
        ddp = DistributedDataParallel(
            module,
            device_ids=[self.device] if self.device is not None and self.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_mb,
            gradient_as_bucket_view=True,
            **no_buffer_sync,
        )
        ddp.register_comm_hook(None, _allreduce_sum)
        self._ddp = ddp
        return ddp

    def grad_sync(self, sync: bool):
        """Context of one micro-step's backward: gradients are all-reduced only when `sync` (the last one)."""
        if self._ddp is None or sync:
            return contextlib.nullcontext()
        return self._ddp.no_sync()

    # -- host-side reductions (float64 on the CPU, over the gloo group) -------------------------

    def sum(self, values) -> np.ndarray:
        """Element-wise sum over ranks of a float vector."""
        array = np.asarray(values, dtype=np.float64)
        if self.world_size == 1:
            return array
        import torch.distributed as dist

        tensor = torch.from_numpy(array.copy())
        dist.all_reduce(tensor, group=self.host_group)
        return tensor.numpy()

    def gather(self, values) -> np.ndarray:
        """[world_size, n]: every rank's float vector."""
        array = np.asarray(values, dtype=np.float64)
        if self.world_size == 1:
            return array[None]
        import torch.distributed as dist

        out = [torch.empty(array.size, dtype=torch.float64) for _ in range(self.world_size)]
        dist.all_gather(out, torch.from_numpy(array.copy()), group=self.host_group)
        return torch.stack(out).numpy()

    def gather_objects(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def broadcast(self, obj, src: int = 0):
        """Rank `src`'s `obj` on every rank."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.host_group)
        return box[0]

    def agree(self, error: str | None) -> None:
        """Raise the same ValueError on every rank if any rank has an `error` (so no rank is left
        waiting in a collective for one that stopped alone)."""
        errors = [(r, e) for r, e in enumerate(self.gather_objects(error)) if e]
        if errors:
            rank, message = errors[0]
            raise ValueError(message if self.world_size == 1 else f"{message} (seen by rank {rank})")

    # -- faults -------------------------------------------------------------------------------

    def is_comm_failure(self, exc: BaseException) -> bool:
        """Whether `exc` looks like a failed collective (only meaningful with other ranks)."""
        if self.world_size == 1 or not isinstance(exc, Exception):
            return False
        import torch.distributed as dist

        if isinstance(exc, (dist.DistError, PeerLost)):
            return True
        # gloo raises a plain RuntimeError; the project's own errors are subclasses and never count.
        text = str(exc).lower()
        return type(exc) is RuntimeError and any(hint in text for hint in _COMM_ERROR_HINTS)

    def peer_lost(self, exc: BaseException, where: str) -> PeerLost:
        """A `PeerLost` for a failed collective, naming the rank(s) that are gone if they can be told."""
        me = self.peers[self.rank] if self.peers else self._me(self.rank, self.local_rank, self.device)
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
        return PeerLost(
            f"rank {self.rank} (pid {me['pid']} on {me['host']}): a collective failed {where}; "
            f"{self.diagnose()}. Cause: {cause}"
        )

    def diagnose(self, wait_s: float = 2.0) -> str:
        """Which ranks are gone: peers on this machine whose process has exited; if none, the ranks
        that do not answer on the rendezvous store within `wait_s` (dead, hung or unreachable)."""
        exited = self._exited_local_peers(wait_s)
        if exited:
            return "lost " + ", ".join(f"rank {p['rank']} (pid {p['pid']} on {p['host']} has exited)" for p in exited)
        silent = self._silent_ranks(wait_s)
        if silent is None:
            return (
                "could not tell which rank failed (the rendezvous store is unreachable: its host, rank 0 or "
                "the launcher, may be the one that died)"
            )
        if not silent:
            return (
                "every rank still answers: a collective timed out or failed on another rank's error (see that "
                "rank's message)"
            )
        hosts = {p["rank"]: p["host"] for p in self.peers}
        return "lost " + ", ".join(
            f"rank {r} (on {hosts.get(r, '?')}: did not answer within {wait_s:.0f} s; dead, hung or unreachable)"
            for r in silent
        )

    def _exited_local_peers(self, wait_s: float) -> list[dict]:
        """Peers on this machine whose process has exited, polled for up to `wait_s / 2`: a killed
        process closes its sockets (failing our collective) a moment before the kernel shows it as
        exited, so a single look can come too early."""
        here = self.peers[self.rank]["host_id"] if self.peers else _host_id()
        local = [p for p in self.peers if p["rank"] != self.rank and p["host_id"] == here]
        deadline = time.monotonic() + wait_s / 2
        while True:
            exited = [p for p in local if _pid_gone(p["pid"])]
            if exited or not local or time.monotonic() >= deadline:
                return exited
            time.sleep(0.02)

    def _silent_ranks(self, wait_s: float) -> list[int] | None:
        try:
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
            run_id, restart = (
                os.environ.get("TORCHELASTIC_RUN_ID", ""),
                os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            )
            prefix = f"dflash/alive/{run_id}/{restart}"
            store.set(f"{prefix}/{self.rank}", json.dumps({"time": time.time()}))
            pending = set(range(self.world_size)) - {self.rank}
            deadline = time.monotonic() + wait_s
            while pending and time.monotonic() < deadline:
                pending = {r for r in pending if not store.check([f"{prefix}/{r}"])}
                time.sleep(0.05)
            return sorted(pending)
        except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
            return None

    # -- consistency --------------------------------------------------------------------------

    def check_in_step(self, data_state: dict, module: torch.nn.Module) -> list[dict]:
        """At a checkpoint: every rank's data position (they must agree: one global plan) and a
        fingerprint of its weights (they must agree: the same update on every rank). Returns the
        positions, one per rank; RuntimeError naming the ranks if they disagree."""
        mine = {
            "rank": self.rank,
            "epoch": data_state.get("epoch"),
            "batch": data_state.get("batch"),
            "parts": list(self.split.mine),
        }
        if self.world_size == 1:
            return [mine]
        with torch.no_grad():
            fingerprint = float(sum(p.detach().sum(dtype=torch.float64) for p in module.parameters()))
        gathered = self.gather_objects((mine, fingerprint))
        positions = [g[0] for g in gathered]
        where = {(p["epoch"], p["batch"]) for p in positions}
        if len(where) > 1:
            raise RuntimeError(
                f"ranks disagree on the data position: {[(p['rank'], p['epoch'], p['batch']) for p in positions]}"
            )
        prints = [g[1] for g in gathered]
        if any(not (f == prints[0] or abs(f - prints[0]) <= 1e-9 * max(1.0, abs(prints[0]))) for f in prints):
            raise RuntimeError(f"ranks hold different weights (parameter sums {prints}): their updates diverged")
        return positions
