"""Short version of scenario 5: generated malformed records, every bad value of every config key,
semantic config errors through the CLIs, and mismatched shards all get a clear answer."""

from __future__ import annotations

from tests.reliability import bad_inputs
from tests.reliability.families import Tally


def test_fuzzed_records_get_a_reason_or_become_samples(world, tmp_path):
    tally, lines = Tally(), []
    bad_inputs.fuzz_records(world, tally, examples=80, seed=None, keep=lines)
    bad_inputs.fuzzed_corpus_runs(world, tally, lines[:80], tmp_path)
    assert not tally.failures, tally.failures[:10]
    assert tally.tried >= 82


def test_every_bad_config_value_is_refused_naming_its_key(world, tmp_path):
    tally = Tally()
    bad_inputs.fuzz_configs(world, tally, examples=30, seed=None, work=tmp_path)
    assert not tally.failures, tally.failures[:10]
    assert tally.tried > 300


def test_semantic_errors_and_mismatched_shards_stop_with_one_clear_line(world, tmp_path):
    tally = Tally()
    bad_inputs.semantic_config_cases(world, tally, tmp_path)
    bad_inputs.mismatched_shards(world, tally, tmp_path)
    assert not tally.failures, tally.failures[:10]
    assert tally.tried == 31


def test_the_judge_catches_a_silent_pass(world):
    """The scenario can fail: a malformed record that became a sample is reported."""
    from extract import corpus as C

    builder = C.SampleBuilder(
        world.target.tokenizer, C.SamplePolicy(256, "truncate", 1, {}, vocab_size=len(world.target.tokenizer))
    )
    good = bad_inputs.as_line(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the quick brown fox"}]}
    )
    assert bad_inputs.judge_record(builder, good, should_pass=True) == (True, "sample")
    ok, what = bad_inputs.judge_record(builder, good, should_pass=False)
    assert not ok and "silent pass" in what


def test_formats_encodings_tool_calls_and_control_tokens_get_a_clear_answer(world, tmp_path):
    from tests.reliability import corpus_inputs

    tally, lines = Tally(), []
    bad_inputs.fuzz_records(world, tally, examples=40, seed=None, keep=lines)
    corpus_inputs.run_all(world, tally, examples=30, seed=None, lines=lines, work=tmp_path)
    assert not tally.failures, tally.failures[:10]
    families = {kind.split(":")[0] for kind in tally.kinds}
    assert {"format", "encoding", "tool_call", "control_token"} <= families


def test_corpus_files_prompts_and_type_confusions_get_a_clear_answer(world, tmp_path):
    """The families of issue 28: directory contents, changing corpora, damaged compressed files,
    over-long regeneration prompts, booleans as token ids and per-turn weights."""
    from tests.reliability import corpus_files

    tally = Tally()
    corpus_files.run_all(world, tally, examples=60, seed=None, work=tmp_path)
    assert not tally.failures, tally.failures[:10]
    families = {kind.split(":")[0] for kind in tally.kinds}
    assert families == {"directory", "changing", "compressed", "prompt_length", "type_confusion"}


def test_the_compressed_judge_catches_a_silent_truncation(world, tmp_path, monkeypatch):
    """The family can fail: a reader that ignores a truncated stream's error is reported."""
    import random

    from extract.corpus import streams
    from tests.reliability import corpus_files

    monkeypatch.setattr(streams, "_damaged", lambda path, err, lines, raw: StopIteration())
    monkeypatch.setattr(streams, "_decode_errors", lambda: (ValueError,))  # swallow nothing: the error escapes
    tally = Tally()
    corpus_files.compressed(tally, random.Random(1), 12, tmp_path)
    assert tally.failures


def test_concurrent_writers_never_both_write(world, tmp_path):
    from tests.reliability import writers

    tally = Tally()
    line = writers.concurrent_writers(world, tally, tmp_path, extraction_pairs=1, training_pairs=0)
    assert not tally.failures, tally.failures
    assert tally.kinds.keys() == {"writers:two_extractions", "writers:crashed_holder"} and "1 extraction pairs" in line


def test_the_tool_call_judge_catches_a_wrong_mask(world):
    """The family can fail: a mask that also covers a tool result is reported."""
    from extract.corpus import rendering
    from tests.extract.conftest import tool_chat_tokenizer
    from tests.reliability import corpus_inputs

    builder = corpus_inputs.builder_for(tool_chat_tokenizer())
    record = {
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "content": "result text"},
            {"role": "assistant", "content": "done"},
        ]
    }
    assert corpus_inputs.judge_chat(builder, record, mask_reference=True) == (True, "sample")
    real = rendering.loss_mask_from_spans

    def also_tool_results(offsets, spans, ids, eot):
        return real(offsets, spans + [(0, 10**6)], ids, eot)

    rendering.loss_mask_from_spans = also_tool_results
    try:
        ok, what = corpus_inputs.judge_chat(builder, record, mask_reference=True)
    finally:
        rendering.loss_mask_from_spans = real
    assert not ok and "loss mask differs" in what


def test_every_commands_config_errors_silent_results_and_the_build_get_one_line(world, tmp_path):
    """Issue 45: ConfigError tracebacks, a run directory written locally for out_dir=s3://, a mask
    token the data holds, a TOML table taken as a folder name."""
    from tests.reliability import command_cases

    tally = bad_inputs.Tally()
    command_cases.run_all(world, tally, tmp_path, full=False)
    assert not tally.failures, tally.failures[:10]
    families = {kind.split(":")[0] for kind in tally.kinds}
    assert families == {"command_config", "silent", "build"} and tally.tried >= 50


def test_store_setup_errors_a_store_gone_and_damage_at_training_get_one_line(world, tmp_path, moto_server):
    """Issue 45: setup errors as raw pyarrow text plus "rerun to resume"; a store gone for 25 s called
    a corrupt shard; damage at training as two tracebacks; no index objects left, "rerunning resumes"."""
    from tests.reliability import store_cases

    tally = bad_inputs.Tally()
    with store_cases.environment(**moto_server.env()):
        store_cases.run_all(world, tally, tmp_path, moto_server)
    assert not tally.failures, tally.failures[:10]
    assert {kind.split(":")[0] for kind in tally.kinds} == {"store_setup", "store_gone", "train_damage"}
    assert tally.kinds["store_gone:for a while"] == (1, 1) and tally.kinds["store_gone:for good"] == (1, 1)


def test_the_one_line_judge_fails_a_traceback_and_a_hint_that_cannot_help():
    from tests.reliability.cli import one_line_problems

    traceback = "Traceback (most recent call last):\n  ...\nValueError: x\ntrain: config key 'data.shards': x\n"
    assert one_line_problems(2, traceback, exit_code=2, says=("data.shards",))[0]
    hint = "train: I/O error, stopping: bucket gone. Rerunning the same command resumes.\n"
    problems, line = one_line_problems(4, hint, exit_code=2, says=("data.shards",), never=("rerun", "resum"))
    assert len(problems) == 4 and line == hint.strip()
    assert one_line_problems(2, "train: config key 'out_dir': x\n", exit_code=2, says=("out_dir",))[0] == []
