"""The plan's resumability (tools/capacity/plan.py, store.py): stored probes are read, not run again; --force
runs them again; a probe file is written whole or not at all."""

import json

import pytest

from tests.tools.capacity.capacity_fixtures import put
from tools.capacity import store
from tools.capacity.plan import Plan, policy_params
from tools.capacity.search import round_rate, warm_grow
from tools.capacity.traffic import KINDS


class ServerWanted(Exception):
    pass


def no_server(policy):
    raise ServerWanted(policy)


def plan(tmp_path, force=False):
    return Plan([KINDS["conv"]], [256], ["full", "balanced"], [0], tmp_path, precision=0.25, max_probes=4, force=force)


def stored_search(tmp_path):
    # full passes at x0.3 and fails at x0.45 and x0.3674; balanced passes at 0.3 and 0.45, fails at 0.675, 0.5511
    for policy, rate, good in [
        ("full", 0.3, 95),
        ("full", 0.45, 50),
        ("full", 0.3674, 80),
        ("balanced", 0.3, 100),
        ("balanced", 0.45, 95),
        ("balanced", 0.675, 40),
        ("balanced", 0.5511, 85),
    ]:
        put(tmp_path, "conv", 256, policy, 0, rate, 100, good)


def test_a_rerun_reads_every_stored_probe_and_starts_no_server(tmp_path, capsys):
    stored_search(tmp_path)
    before = {p: p.stat().st_mtime_ns for p in store.stored(tmp_path)}
    plan(tmp_path)._run_pool(KINDS["conv"], 256, no_server, prompts=None)
    out = capsys.readouterr().out
    assert "full: capacity x0.3 (converged" in out and "balanced: capacity x0.45 (converged" in out
    assert out.count("(stored)") == 7
    assert {p: p.stat().st_mtime_ns for p in store.stored(tmp_path)} == before


def test_a_missing_probe_is_run(tmp_path):
    stored_search(tmp_path)
    store.ProbeKey("conv", 256, "balanced", 0, 0.5511).path(tmp_path).unlink()
    with pytest.raises(ServerWanted, match="balanced"):
        plan(tmp_path)._run_pool(KINDS["conv"], 256, no_server, prompts=None)


def test_force_runs_stored_probes_again(tmp_path):
    stored_search(tmp_path)
    with pytest.raises(ServerWanted, match="full"):
        plan(tmp_path, force=True)._run_pool(KINDS["conv"], 256, no_server, prompts=None)


def test_store_layout_and_no_half_files(tmp_path):
    path = put(tmp_path, "conv", 512, "int4:10", 2, 0.25, 10, 10)
    assert path.relative_to(tmp_path).as_posix() == "raw/conv/pool512/int4-10/seed2/x0.25.json"
    assert not list(tmp_path.rglob("*.tmp"))
    data = json.loads(path.read_text())
    assert data["policy"] == "int4:10" and data["probe"]["rate"] == 0.25 and len(data["records"]) == 10


def test_a_pool_too_small_for_one_request_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot hold one conv request"):
        Plan([KINDS["conv"]], [128], ["full"], [0], tmp_path)


def test_not_a_probe_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match="not a capacity probe file"):
        store.load_probe(bad)


def test_policy_variants_become_server_parameters(tmp_path):
    assert policy_params("balanced") == ("balanced", {})
    assert policy_params("balanced+up_quiet_s=10+down_persist=1") == (
        "balanced",
        {"morph_up_quiet_s": "10", "morph_down_persist": "1"},
    )
    path = store.ProbeKey("conv", 256, "balanced+up_quiet_s=10", 0, 0.1).path(tmp_path)
    assert path.parent.parent.name == "balanced+up_quiet_s=10"
    with pytest.raises(ValueError, match="expected POLICY\\+NAME=VALUE"):
        Plan([KINDS["conv"]], [256], ["balanced+up_quiet_s"], [0], tmp_path)


def test_sched_variant_sets_the_capacity_policy():
    assert policy_params("full+sched=no_evict") == ("full", {"batch_scheduler_policy": "guaranteed_no_evict"})
    assert policy_params("balanced+sched=max_util")[1] == {"batch_scheduler_policy": "max_utilization"}
    with pytest.raises(ValueError, match="sched takes no_evict or max_util, got 'fifo'"):
        policy_params("full+sched=fifo")
    assert policy_params("balanced+xreuse=on") == ("balanced", {"kv_cache_reuse_across_morphs": "true"})


def test_warm_bracket_costs_a_seed_two_probes_near_the_previous_capacity(tmp_path, capsys):
    # seed 0 as stored above (full x0.3, balanced x0.45); seed 1 passes 5% above: x0.3 / x0.45 pass, one step up fails
    stored_search(tmp_path)
    for policy, cap in [("full", 0.3), ("balanced", 0.45)]:
        put(tmp_path, "conv", 256, policy, 1, cap, 100, 95)
        put(tmp_path, "conv", 256, policy, 1, round_rate(cap * warm_grow(0.25)), 100, 50)
    warm = Plan(
        [KINDS["conv"]], [256], ["full", "balanced"], [0, 1], tmp_path, precision=0.25, max_probes=4, warm_bracket=True
    )
    warm._run_pool(KINDS["conv"], 256, no_server, prompts=None)
    out = capsys.readouterr().out
    assert "seed 1 full: capacity x0.3 (converged, 2 probes)" in out
    assert "seed 1 balanced: capacity x0.45 (converged, 2 probes)" in out
    # without the flag the same seed brackets by x1.5 and wants a probe not stored
    cold = Plan([KINDS["conv"]], [256], ["full", "balanced"], [0, 1], tmp_path, precision=0.25, max_probes=4)
    with pytest.raises(ServerWanted):
        cold._run_pool(KINDS["conv"], 256, no_server, prompts=None)


def test_overload_probes_every_policy_at_a_multiple_of_fulls_capacity_and_marks_them(tmp_path, capsys):
    # seed 0's searches stored (full x0.3, balanced x0.45): the overload probes at x0.375 are all that is missing
    stored_search(tmp_path)
    over = Plan(
        [KINDS["conv"]], [256], ["full", "balanced"], [0], tmp_path, precision=0.25, max_probes=4, overload=1.25
    )
    with pytest.raises(ServerWanted, match="full"):
        over._run_pool(KINDS["conv"], 256, no_server, prompts=None)
    put(tmp_path, "conv", 256, "full", 0, 0.375, 100, 40)
    put(tmp_path, "conv", 256, "balanced", 0, 0.375, 100, 99)
    over._run_pool(KINDS["conv"], 256, no_server, prompts=None)
    assert capsys.readouterr().out.count("x0.375 (x1.25 full's capacity)") == 2
    for policy in ("full", "balanced"):  # a stored probe at that rate is marked, not run again
        assert (
            store.load_probe(store.ProbeKey("conv", 256, policy, 0, 0.375).path(tmp_path))["overload_of_full"] == 1.25
        )


def test_repeats_rerun_the_probes_either_side_of_each_capacity_and_change_no_capacity(tmp_path, capsys):
    stored_search(tmp_path)  # full: pass x0.3, fail x0.3674; balanced: pass x0.45, fail x0.5511
    again = Plan(
        [KINDS["conv"]], [256], ["full", "balanced"], [0], tmp_path, precision=0.25, max_probes=4, repeat_nearest=1
    )
    with pytest.raises(ServerWanted, match="full"):
        again._run_pool(KINDS["conv"], 256, no_server, prompts=None)
    for policy, rate, good in [
        ("full", 0.3, 85),
        ("full", 0.3674, 70),
        ("balanced", 0.45, 96),
        ("balanced", 0.5511, 91),
    ]:
        put(tmp_path, "conv", 256, policy, 0, rate, 100, good, repeat=1)
    again._run_pool(KINDS["conv"], 256, no_server, prompts=None)
    out = capsys.readouterr().out
    assert out.count("(repeat 1)") == 4 and "x0.3 (repeat 1)" in out and "x0.5511 (repeat 1)" in out
    assert "full: capacity x0.3 (converged" in out and "balanced: capacity x0.45 (converged" in out
    assert len(store.stored(tmp_path)) == 7 and len(store.repeats(tmp_path)) == 4


def test_repeat_paths_are_apart_from_the_searches_probes(tmp_path):
    first = put(tmp_path, "conv", 256, "full", 0, 0.3, 10, 10)
    second = put(tmp_path, "conv", 256, "full", 0, 0.3, 10, 5, repeat=2)
    assert second.name == "x0.3.r2.json" and store.load_probe(second)["repeat"] == 2
    assert store.stored(tmp_path) == [first] and store.repeats(tmp_path) == [second]
    with pytest.raises(ValueError, match="repeat_nearest"):
        Plan([KINDS["conv"]], [256], ["full"], [0], tmp_path, repeat_nearest=-1)


def test_an_overload_multiple_of_one_or_less_is_refused(tmp_path):
    with pytest.raises(ValueError, match="must be above 1"):
        Plan([KINDS["conv"]], [256], ["full"], [0], tmp_path, overload=1.0)


def test_a_small_pool_is_judged_by_the_kv_each_server_starts_with(tmp_path):
    from tools.capacity.plan import check_starting_kv

    conv = KINDS["conv-kv"]
    # The INT8 head's freed bytes become KV at load: the nominal pool no longer decides, each server does.
    Plan([conv], [256], ["full", "balanced"], [0], tmp_path, params={"lm_head_precision": "int8"})
    with pytest.raises(ValueError, match="cannot hold one conv-kv request"):
        Plan([conv], [256], ["full"], [0], tmp_path, params={"lm_head_precision": "full"})
    assert check_starting_kv({"kv_blocks": 92}, 16, conv, 256, "full") == 1472
    with pytest.raises(ValueError, match=r"full\+lm_head=full at pool 256 starts with 256 KV tokens"):
        check_starting_kv({"kv_blocks": 16}, 16, conv, 256, "full+lm_head=full")


class _Started:
    """A stand-in server context: records its start and stop."""

    def __init__(self, log: list, policy: str):
        self.log, self.policy = log, policy

    def __enter__(self):
        self.log.append(("start", self.policy))
        return f"handle-{self.policy}-{len(self.log)}"

    def __exit__(self, *exc):
        self.log.append(("stop", self.policy))


@pytest.mark.parametrize("fresh", [False, True])
def test_servers_are_kept_across_probes_unless_each_probe_needs_a_cold_cache(fresh):
    from tools.capacity.plan import ProbeServers

    log, checks = [], []
    start = lambda policy: (_Started(log, policy), 16)  # noqa: E731
    ready = lambda policy, handle, block_size: checks.append((policy, block_size))  # noqa: E731
    with ProbeServers(start, ready, fresh=fresh) as servers:
        first = servers.get("full")
        second = servers.get("full")
        servers.get("balanced")
    if fresh:  # multi-turn traffic: a new server (and a new start check) for every probe
        assert first != second
        assert log == [("start", "full"), ("stop", "full"), ("start", "full"), ("start", "balanced")] + [
            ("stop", "full"),
            ("stop", "balanced"),
        ]
        assert checks == [("full", 16), ("full", 16), ("balanced", 16)]
    else:  # kept: the second probe waits for the server to go idle instead
        assert first == second
        assert log == [("start", "full"), ("start", "balanced"), ("stop", "full"), ("stop", "balanced")]
        assert checks == [("full", 16), ("full", None), ("balanced", 16)]
