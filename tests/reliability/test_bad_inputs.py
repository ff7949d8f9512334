"""Short version of scenario 5: generated malformed records, every bad value of every config key,
semantic config errors through the CLIs, and mismatched shards all get a clear answer."""

from __future__ import annotations

from tests.reliability import bad_inputs


def test_fuzzed_records_get_a_reason_or_become_samples(world, tmp_path):
    tally, lines = bad_inputs.Tally(), []
    bad_inputs.fuzz_records(world, tally, examples=80, seed=None, keep=lines)
    bad_inputs.fuzzed_corpus_runs(world, tally, lines[:80], tmp_path)
    assert not tally.failures, tally.failures[:10]
    assert tally.tried >= 82


def test_every_bad_config_value_is_refused_naming_its_key(world, tmp_path):
    tally = bad_inputs.Tally()
    bad_inputs.fuzz_configs(world, tally, examples=30, seed=None, work=tmp_path)
    assert not tally.failures, tally.failures[:10]
    assert tally.tried > 300


def test_semantic_errors_and_mismatched_shards_stop_with_one_clear_line(world, tmp_path):
    tally = bad_inputs.Tally()
    bad_inputs.semantic_config_cases(world, tally, tmp_path)
    bad_inputs.mismatched_shards(world, tally, tmp_path)
    assert not tally.failures, tally.failures[:10]
    assert tally.tried == 31


def test_the_judge_catches_a_silent_pass(world):
    """The scenario can fail: a malformed record that became a sample is reported."""
    from extract import corpus as C

    builder = C.SampleBuilder(world.target.tokenizer, C.SamplePolicy(256, "truncate", 1, {}, vocab_size=len(world.target.tokenizer)))
    good = bad_inputs.as_line({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the quick brown fox"}]})
    assert bad_inputs.judge_record(builder, good, should_pass=True) == (True, "sample")
    ok, what = bad_inputs.judge_record(builder, good, should_pass=False)
    assert not ok and "silent pass" in what
