"""Short version of scenario 5's families of issue 54 (the Makefile's: tests/test_makefile.py): signals
to commands in real processes, late checks, the records of the GPU suites, and an extraction into a
store gone for good."""

from __future__ import annotations

from tests.reliability import late_checks, outage_cases, record_cases, signal_cases
from tests.reliability.families import Tally
from tests.reliability.store_cases import environment


def test_a_stopped_drafter_command_stops_its_step_and_resumes_and_ctrl_c_is_one_line(world, tmp_path):
    """SIGTERM left the step's process running detached, Ctrl-C printed KeyboardInterrupt tracebacks."""
    tally = Tally()
    signal_cases.run_all(world, tally, tmp_path, full=False)
    assert not tally.failures, tally.failures
    assert {kind.split(":")[1] for kind in tally.kinds} == {
        "drafter SIGTERM",
        "drafter Ctrl-C, rerun",
        "Ctrl-C extract",
        "Ctrl-C eval",
    }


def test_what_can_be_checked_before_the_first_step_is_checked_there(world, tmp_path):
    """Tap ids beyond the target, a target without a tokenizer or weights, a prompt line that is not UTF-8,
    text prompts, the tier comparison's sets: refused (or answered) up front, in one line."""
    tally = Tally()
    late_checks.run_all(world, tally, tmp_path)
    assert not tally.failures, tally.failures
    assert tally.tried == 10


def test_a_malformed_suite_record_is_refused_before_it_is_kept(tmp_path):
    tally = Tally()
    record_cases.run_all(tally, tmp_path)
    assert not tally.failures, tally.failures
    assert tally.tried == len(record_cases.MALFORMED) + 3


def test_an_extraction_into_a_store_gone_for_good_stops_in_time_and_resumes(world, tmp_path, moto_server):
    """With DFLASH_S3_OUTAGE_S=4 an extraction was still running 264 s after its store went away."""
    tally = Tally()
    with environment(**moto_server.env()):
        outage_cases.extraction_gone(world, tally, tmp_path, moto_server)
    assert not tally.failures, tally.failures
    assert tally.kinds == {"store_outage:extraction": (1, 1)}
