"""Child process for the kill test: resume the dataset at ROOT and write samples 0..N-1 that are not
committed yet, in small shards, printing 'ready' once the writer is open and 'wrote' after every
sample. The parent SIGKILLs it.

    python -m tests.shards.writer_child ROOT N
"""

from __future__ import annotations

import sys

from shards import ShardWriter
from tests.shards.synth import TOPK, WIDTH, make_sample, provenance


def main(root: str, n: int) -> None:
    with ShardWriter(root, provenance=provenance(), hidden_width=WIDTH, topk=TOPK, shard_bytes=6_000) as w:
        done = w.committed_ids()
        print("ready", flush=True)
        for i in range(n):
            sample = make_sample(i)
            if sample.sample_id in done:
                continue
            w.write(sample)
            w.stage_state["written_up_to"] = i + 1
            w.extra_counts["written"] += 1
            print("wrote", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
