"""Ranks of an extraction: which samples each rank extracts, the files each rank writes and the
names of the dataset's merged files.

One process per GPU (`torchrun` / `accelerate launch`; or RANK / WORLD_SIZE env vars and a
separate `python -m extract.merge`). Every rank reads and tokenizes the whole corpus and keeps the
samples whose `int(sample_id, 16) % world_size` is its rank, so the finished dataset holds the
same samples whatever the world size. Records that never get an id (unparseable lines) belong to
rank `position % world_size`. Rank r writes `r{r:03d}-shard-*.arrow`, `manifest.rank{r:03d}.json`
and `rejects.rank{r:03d}.jsonl`; when all ranks are done, `manifest.json` and `rejects.jsonl` are
merged from them (`extract.merge`).
"""

from __future__ import annotations

import dataclasses
import datetime
import os

FINAL_MANIFEST = "manifest.json"
FINAL_REJECTS = "rejects.jsonl"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "extract_config.json"


@dataclasses.dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: bool = False  # a torch.distributed process group exists (barrier available)

    @classmethod
    def from_env(cls) -> Ranks:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
        group = False
        if world > 1 and "MASTER_ADDR" in os.environ:
            import torch.distributed as dist

            if not dist.is_initialized():
                # gloo: only a barrier at the end; long timeout, since ranks may finish hours apart.
                dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(hours=48))
            group = True
        return cls(rank, world, local_rank, group)

    def barrier(self) -> None:
        if self.group:
            import torch.distributed as dist

            dist.barrier()

    def owns(self, sample_id: str | None, position: int) -> bool:
        if sample_id is None:
            return position % self.world == self.rank
        return int(sample_id, 16) % self.world == self.rank

    @property
    def names(self) -> dict:
        r = f"{self.rank:03d}"
        return {"manifest": f"manifest.rank{r}.json", "prefix": f"r{r}-shard", "rejects": f"rejects.rank{r}.jsonl"}


def rank_names(rank: int) -> dict:
    return Ranks(rank=rank, world=rank + 1).names
