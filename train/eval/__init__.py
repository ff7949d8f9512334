"""Offline evaluation of DFlash and DFlash2 drafters: per-position acceptance, chain τ and DDTree-B τ.

    python -m train.eval CHECKPOINT [CHECKPOINT2] --data SHARDS [--out PATH] [--config FILE] [key=value ...]
    make eval CKPT=runs/abl/checkpoints/step-00001000 DATA=artifacts/tiny/shards/heldout
    python -m train.eval --help                 # every key with its default and allowed values

CHECKPOINT is a checkpoint directory (`runs/NAME/checkpoints/step-XXXXXXXX`) or a run directory
(its latest checkpoint is taken). The frozen embedding / lm_head come from the target the run was
trained with (`target=` overrides). With two checkpoints both are evaluated on exactly the same
blocks (one pass over the data) and the table shows them side by side with the ratio second/first.

What is measured (docs/dflash.md "Acceptance length (τ)", "DDTree"). One block per anchor a: `[x_a,
MASK x D]` at positions a..a+D (D = block_size - 1 = 15), context = the target's tap features of
positions < a, the same inputs online decoding gives the drafter right after the target produced
x_a. The target's continuation y_k (k = 1..D) is its stored greedy token for position a+k,
`topk_ids[a+k-1, 0]`. Anchors: every response (loss-mask) position a whose next position is a
response position too, or `max_anchors` of them per sequence drawn deterministically from (seed,
sample id). A block's valid length L is the number of leading positions a+1, a+2, ... that are still
inside the same response (at most D): online, the response ends there, so such a round can accept at
most L drafts (`train.eval.acceptance`, cut blocks). Metrics, overall and per sequence-length
bucket:
  - per-position acceptance k = 1..D, unconditional and conditional on reaching k;
  - chain τ = 1 + leading accepted drafts (the bonus token included) and its surrogate;
  - DDTree-B τ for each budget (best-first tree over the drafter's top-B log-probs per depth,
    walked by the target's tokens; `train.eval.ddtree`) and its surrogate expectation;
  - the fraction of blocks with all D drafts accepted (a cut block never is).
A DFlash2 checkpoint is measured on what it serves, its candidate selector's proposals (the greedy
walk for the chain; DDTree over the conditional tree of the selector's q over its candidates,
`train.eval.selector`), and on its unary ones (the argmax and its tree) beside them on the same
blocks (JSON `unary`, rows `unary: ...`).
These are averages over blocks (anchors), not the per-response mean of per-round τ that online
benchmarks report, and the labels are the target's greedy tokens *given the data prefix*: they equal
online greedy decoding only where the data is the target's own greedy output (docs/dflash.md "Acceptance length (τ)").

Most-frequent-label baseline, on the same blocks (JSON `baseline`, rows `most-frequent-label
baseline: ...`): a draft-free "drafter" whose distribution at every depth of every block is the
frequency of the labels at the valid positions of these very blocks. Its chain drafts the most
frequent label everywhere, its DDTree holds the most frequent labels at every depth. A drafter is
only worth its margin over this.

Data. If `--data` is the dataset the run trained on (same manifest digest as in run.json, or the
same path), only its held-out split is evaluated (`is_holdout` with the run's
`data.holdout_fraction`; with two runs the smaller fraction, so no sample either run trained on is
used); any other dataset is evaluated whole (`split=` overrides). Shards that do not fit the
drafter are refused (`train.samples.check_compatible`). Buckets: the run's `data_plan.json` boundaries
unless `boundaries=` is set; an empty bucket is reported as empty.

Output: a table on stdout (a pure function of the JSON: `render_report`) and a JSON file (`--out`,
default `eval_<data-name>.json` inside the first checkpoint directory, `<data-name>` being the
dataset directory's name plus `-holdout` for a held-out split, and `_vs_<run>-<step>` with a second
checkpoint) holding the resolved eval config, the checkpoint paths, the data manifest digest, a
digest of the exact blocks, and every number the table shows.

Batching (`drafting.py`): the anchors of a sequence are evaluated many blocks per forward with the
training mask (`train.attention`), several short sequences per forward, context trimmed to the last
anchor of the forward. Logits exist for `chunk_rows` block tokens at a time; only the top-max(budgets)
log-probs per depth are kept. Works on CPU (fp32, dense mask + SDPA) and CUDA (bf16 autocast, flex
attention where its kernel fits the head dim: `train.kernels`, the trainer's own choice); DDTree
scoring runs on the CPU (in a background thread when the drafter is on CUDA).

Shape legend: T tokens of a sample, F tap feature width, A anchors of a piece, D draft positions
(block_size - 1), K block size, R rows of a forward, N blocks per row, S context, Q = N*K, P = S+Q,
M kept blocks of a forward, k kept top-k per depth, V vocabulary.

Modules, one job each: `config` (EvalConfig), `checkpoints` (what a checkpoint says; the drafter and
its target head), `selection` (which samples, length buckets), `anchors` (the blocks of a sample),
`drafting` (batched forwards, the kernel choice), `scoring` (chain and DDTree τ per block, summaries),
`baseline` (most-frequent-label baseline), `run` (one evaluation, the JSON report), `render` (the
table), `acceptance`, `ddtree` and `selector` (pure functions shared with speculative decoding),
`__main__` (CLI).
"""
