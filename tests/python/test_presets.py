"""The one list of presets (cache_manager/policy/presets.txt): the client's PRESETS are its
names, in its order, and the daemon expands each one as the file says."""

from pathlib import Path

import pytest

from daemon import REPO_ROOT
from kvcache_client import PRESETS, SCORING_PRESETS, Policy

PRESETS_FILE = REPO_ROOT / "cache_manager" / "policy" / "presets.txt"


def file_rows():
    rows = []
    for line in PRESETS_FILE.read_text().splitlines():
        columns = line.split("#", 1)[0].split()
        if columns:
            rows.append(columns)
    return rows


def test_presets_are_the_files_names_in_its_order():
    assert PRESETS == tuple(row[0] for row in file_rows())
    assert PRESETS[:2] == ("inertia", "inertia_lazy4")


def test_the_package_ships_the_same_file():
    import kvcache_client
    shipped = Path(kvcache_client.__file__).with_name("presets.txt")
    assert shipped.read_text() == PRESETS_FILE.read_text()


def test_scoring_presets_are_those_whose_aggregation_reads_scores():
    assert SCORING_PRESETS == ("inertia", "inertia_lazy4", "score_free", "tova", "h2o")


@pytest.mark.parametrize("row", file_rows(), ids=lambda row: row[0])
def test_the_daemon_expands_each_preset_as_the_file_says(client, seq_id, row):
    name, aggregation, alpha, refresh, interval, recent, sinks = row
    budget = 40  # holds every preset's protections
    state = client.open_sequence(seq_id(name), 100, budget_tokens=budget, policy=name)
    try:
        resolved = state.policy
        assert resolved.preset == name
        assert resolved.aggregation == aggregation
        if alpha != "-":
            assert resolved.alpha == pytest.approx(float(alpha))
        if refresh != "-":
            assert resolved.refresh == refresh
        if interval != "-":
            assert resolved.refresh_interval == int(interval)
        want_recent = budget // int(recent.split("/")[1]) if "/" in recent else int(recent)
        assert (resolved.protect_recent, resolved.protect_sinks) == (want_recent, int(sinks))
        assert state.next_needs_scores == (name in SCORING_PRESETS)
    finally:
        client.close_sequence(state.sequence_id)


def test_an_unknown_preset_is_refused_with_the_list(client, seq_id):
    from kvcache_client import KvCacheError
    with pytest.raises(KvCacheError, match="inertia, inertia_lazy4, score_free"):
        client.open_sequence(seq_id(), 100, budget_tokens=10, policy=Policy(preset="nope"))
