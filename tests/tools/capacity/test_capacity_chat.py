"""Multi-turn and mixed-priority traffic in the capacity harness (issue 45): the chat kinds' probes, each request's
priority kept in its record, attainment per priority class in the report, and prefix reuse on/off as a policy
variant (tools/capacity/{traffic,classes,reuse,plan}.py)."""

import asyncio
import json

import pytest

from tests.tools.capacity.capacity_fixtures import put, records
from tests.tools.capacity.test_capacity_conversations import _Prompts
from tools.capacity.analysis import analyse, classes
from tools.capacity.conversations import BATCH, INTERACTIVE
from tools.capacity.plan import Plan, policy_params
from tools.capacity.report import write_report
from tools.capacity.stats import ratio_interval
from tools.capacity.traffic import KINDS
from tools.replay import metrics as rm
from tools.replay.client import Planned, RequestRecord
from tools.replay.paths import repo_path
from tools.replay.result import load_raw, save_raw
from tools.replay.runner import run_window
from tools.replay.sampler import snapshot

CHAT = ("chat-kv", "chat-kv-mixed")


def _need_trace():
    if not repo_path(KINDS["chat-kv"].trace).exists():
        pytest.skip("Azure conversation trace not present")


@pytest.mark.parametrize("name", CHAT)
def test_a_chat_kind_replays_the_same_turns_at_every_rate(name):
    _need_trace()
    kind = KINDS[name]
    slow, s1 = kind.planned(kind.start_rate_scale, 0, _Prompts())
    fast, s2 = kind.planned(2 * kind.start_rate_scale, 0, _Prompts())
    assert len(slow) >= kind.min_requests and s2.duration_s == pytest.approx(s1.duration_s / 2)
    same = lambda ps: [(p.prompt, p.output_tokens, p.priority) for p in ps]  # noqa: E731
    assert same(slow) == same(fast)
    assert [p.arrival_s for p in fast] == pytest.approx([p.arrival_s / 2 for p in slow])
    assert same(kind.planned(kind.start_rate_scale, 1, _Prompts())[0]) != same(slow)  # seeds differ
    # most turns resend an earlier prompt of their conversation: a prefix the server may reuse
    resent = sum(any(p.prompt.startswith(q.prompt + "\n") for q in slow[:i]) for i, p in enumerate(slow))
    assert resent > len(slow) / 2


def test_the_mixed_kind_is_the_plain_one_with_priorities():
    _need_trace()
    plain, _ = KINDS["chat-kv"].planned(0.05, 0, _Prompts())
    mixed, _ = KINDS["chat-kv-mixed"].planned(0.05, 0, _Prompts())
    assert [(p.prompt, p.arrival_s) for p in plain] == [(p.prompt, p.arrival_s) for p in mixed]
    assert {p.priority for p in plain} == {0} and {p.priority for p in mixed} == {INTERACTIVE, BATCH}
    assert 0.1 < sum(p.priority == INTERACTIVE for p in mixed) / len(mixed) < 0.35
    assert "20% of conversations interactive (priority 0)" in KINDS["chat-kv-mixed"].describe()


def test_a_thinned_chat_variant_keeps_its_conversations():
    v = KINDS["chat-kv-mixed"].variant(0.02, 50)
    assert v.name == "chat-kv-mixed-thin0.02" and v.conversations == KINDS["chat-kv-mixed"].conversations


def test_every_turn_fits_the_bound_pools_are_checked_against():
    _need_trace()
    try:
        from tools.replay.prompts import PromptSource, load_tokenizer

        prompts = PromptSource(load_tokenizer())
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"tokenizer or corpus not present: {exc}")
    kind = KINDS["chat-kv"]
    for seed in range(3):
        planned, _ = kind.planned(kind.start_rate_scale, seed, prompts)  # raises past max_tokens()
        assert max(p.prompt_tokens + p.output_tokens for p in planned) > 700  # long conversations do occur


def test_each_record_keeps_the_priority_it_was_sent_with(tmp_path):
    class Target:
        async def send(self, p, rec, clock):
            rec.send_s = rec.first_token_s = rec.end_s = clock.now()
            rec.token_s, rec.status = [rec.end_s], "ok"

    planned = [Planned(i, 0.0, "x", 1, 1, priority) for i, priority in enumerate((0, 5, 5))]
    res = asyncio.run(run_window(planned, Target(), None, None, 1.0, False, None, 0))
    assert [r.priority for r in res.records] == [0, 5, 5]
    save_raw(tmp_path / "r.json", "full", res)
    assert [r.priority for r in load_raw(tmp_path / "r.json")[1].records] == [0, 5, 5]
    old = {k: v for k, v in json.loads((tmp_path / "r.json").read_text())["records"][0].items() if k != "priority"}
    assert RequestRecord(**old).priority == 0  # files stored before the field read as priority 0


def test_classes_split_attainment_by_priority():
    prios = [INTERACTIVE] * 4 + [BATCH] * 6
    recs = records(10, good=7, priorities=prios)  # the first 7 meet the SLOs: all interactive, 3 of 6 batch
    got = classes(recs, rm.Slo(2.0, 0.35))
    assert set(got) == {"0", "5"}
    assert got["0"]["requests"] == 4 and got["0"]["attainment"] == 1.0
    assert got["5"]["attainment"] == 0.5 and got["5"]["misses"]["ttft"] == 3
    assert got["5"]["ttft_p95"] == pytest.approx(5.0)
    assert classes(records(5, 5), rm.Slo(2.0, 0.35)) == {}  # one class: nothing to split


def test_the_report_shows_each_class_and_the_interactive_target(tmp_path):
    out = tmp_path / "cap"
    prios = ([INTERACTIVE] * 2 + [BATCH] * 8) * 10  # 20 interactive of 100
    first = lambda k: [INTERACTIVE] * k + [BATCH] * (100 - k)  # noqa: E731
    for seed in (0, 1):
        put(out, "chat-kv-mixed", 256, "full", seed, 0.05, 100, 95, priorities=prios)
        put(out, "chat-kv-mixed", 256, "full", seed, 0.06, 100, 60, priorities=prios)  # full's capacity: x0.05
        # x1.5 of it: full misses 40% of each class, balanced keeps every interactive request (sorted first)
        put(out, "chat-kv-mixed", 256, "full", seed, 0.075, 100, 40, priorities=first(20))
        put(out, "chat-kv-mixed", 256, "balanced", seed, 0.075, 100, 70 - seed * 52, priorities=first(20))
    write_report(out, tmp_path / "c.json", tmp_path / "none.json", "cmd")
    text = (out / "report.md").read_text()
    assert "Per priority class (a probe's verdict is on all its requests" in text
    assert "| 0 | 0.075 | balanced | yes | 70.0% (fail), 5.00 | 20, 100.0%, 0.50, 0 / 0 / 0 / 0 | 80, 62.5%, " in text
    assert "| 0 | 0.05 | full | no | 95.0% (pass)" in text
    assert "- `balanced` above full's capacity: interactive attainment >= 95% in 1 of 2 probes (lowest 90.0%" in text
    assert "**missed**" in text.split("- `balanced` above")[1].splitlines()[0]
    data = json.loads((tmp_path / "c.json").read_text())["cells"][0]["priority_classes"]
    assert data["interactive_target"]["balanced"] == {"probes": 2, "met": 1, "lowest": 0.9, "target": 0.95}
    # full above its capacity: x0.06 (classes interleaved: 12 of 20 interactive met), x0.075 (all 20 met)
    assert data["interactive_target"]["full"] == {"probes": 4, "met": 2, "lowest": 0.6, "target": 0.95}
    row = next(r for r in data["probes"] if r["policy"] == "balanced" and r["seed"] == 1)
    assert row["above_full_capacity"] and row["classes"]["0"]["attainment"] == pytest.approx(18 / 20)


def test_a_plain_kind_has_no_class_section(tmp_path):
    out = tmp_path / "cap"
    put(out, "conv", 256, "full", 0, 0.1, 100, 95)
    write_report(out, tmp_path / "c.json", tmp_path / "none.json", "cmd")
    assert "Per priority class" not in (out / "report.md").read_text()
    assert "priority_classes" not in json.loads((tmp_path / "c.json").read_text())["cells"][0]


def test_prefix_off_is_a_policy_variant():
    assert policy_params("full+prefix=off") == ("full", {"enable_kv_cache_reuse": "false"})
    assert policy_params("balanced+prefix=on+lm_head=full") == (
        "balanced",
        {"enable_kv_cache_reuse": "true", "lm_head_precision": "full"},
    )
    with pytest.raises(ValueError, match="prefix takes on or off, got 'no'"):
        policy_params("full+prefix=no")
    from trtllm_backend.triton.params import PARAMS

    names = {p.name for p in PARAMS}
    assert {"enable_kv_cache_reuse", "lm_head_precision"} <= names  # what the variants set is a server parameter


def test_reuse_on_and_off_are_compared_at_equal_memory(tmp_path):
    out = tmp_path / "cap"
    caps = {
        "full": (0.05, 0.06),
        "full+prefix=off": (0.04, 0.04),
        "balanced": (0.1, 0.09),
        "balanced+prefix=off": (0.05, 0.06),
    }
    for policy, per_seed in caps.items():
        for seed, cap in enumerate(per_seed):
            reused = 0 if "off" in policy else 500  # of 100 x 20 prompt tokens sent: 25%
            put(out, "chat-kv", 256, policy, seed, cap, 100, 95, reused_tokens=reused)
            put(out, "chat-kv", 256, policy, seed, round(cap * 1.2, 4), 100, 50, reused_tokens=reused)
    write_report(out, tmp_path / "c.json", tmp_path / "none.json", "cmd")
    text = (out / "report.md").read_text()
    assert "| full+prefix=off |" in text and "| balanced+prefix=off |" in text  # the main table labels them
    section = text.split("Prefix reuse: ")[1].split("\n\n")[1]
    ratio = ratio_interval([0.1, 0.09], [0.05, 0.06])
    assert "| balanced | 0.095 [" in section and f"| {ratio.fmt()} | 0: 2.00, 1: 1.50 | 25% |" in section
    assert "| full | " in section and "| 0: 1.25, 1: 1.50 | 25% |" in section
    data = json.loads((tmp_path / "c.json").read_text())["cells"][0]
    assert data["prefix_reuse"]["balanced"]["without"] == "balanced+prefix=off"
    assert data["prefix_reuse"]["balanced"]["per_seed"] == {"0": 2.0, "1": 1.5}
    assert data["policies"]["full"]["prefix_reused_share"] == pytest.approx(0.25)
    assert data["policies"]["full+prefix=off"]["prefix_reused_share"] == 0


def test_the_reused_tokens_counter_is_sampled():
    text = 'morphserve_prefix_cache_reused_tokens_total{model="smollm2",version="1"} 4096\n'
    assert snapshot(text, model="smollm2") == {"prefix_reused_tokens": 4096}


class ServerWanted(Exception):
    pass


def _no_server(policy):
    raise ServerWanted(policy)


def test_overload_only_searches_full_alone_then_probes_every_policy(tmp_path, capsys):
    # full's search stored (capacity x0.3, fails at x0.45 and x0.3674) and its probe at x1.5 of it, x0.45
    for rate, good in [(0.3, 95), (0.45, 50), (0.3674, 80)]:
        put(tmp_path, "conv", 256, "full", 0, rate, 100, good)
    plan = Plan(
        [KINDS["conv"]],
        [256],
        ["full", "balanced"],
        [0],
        tmp_path,
        precision=0.25,
        max_probes=4,
        overload=1.5,
        overload_only=True,
    )
    with pytest.raises(ServerWanted, match="balanced"):  # no balanced search: its one probe at x0.45 is next
        plan._run_pool(KINDS["conv"], 256, _no_server, prompts=None)
    log = capsys.readouterr().out
    assert "seed 0 full: capacity x0.3" in log and "balanced: capacity" not in log
    assert "x0.45 (x1.5 full's capacity)" in log


def test_overload_only_needs_a_multiple_and_full(tmp_path):
    with pytest.raises(ValueError, match="overload only"):
        Plan([KINDS["conv"]], [256], ["full", "balanced"], [0], tmp_path, overload_only=True)
    with pytest.raises(ValueError, match="overload only"):
        Plan([KINDS["conv"]], [256], ["balanced"], [0], tmp_path, overload=1.5, overload_only=True)


def test_analysis_reads_probes_stored_before_priorities_and_reuse(tmp_path):
    put(tmp_path, "conv", 256, "full", 0, 0.1, 10, 10)
    n = analyse(tmp_path, None)[("conv", 256)]["full"].at_capacity[0]
    assert n["classes"] == {} and n["prefix_reused_tokens"] != n["prefix_reused_tokens"]  # nan: no gauge


def test_the_closed_loop_kind_plays_chat_kvs_turns_as_a_chat_client():
    _need_trace()
    open_, _ = KINDS["chat-kv"].planned(0.05, 0, _Prompts())
    closed, _ = KINDS["chat-kv-closed"].planned(0.05, 0, _Prompts())
    assert [(p.arrival_s, p.output_tokens, p.prompt_tokens) for p in open_] == [
        (p.arrival_s, p.output_tokens, p.prompt_tokens) for p in closed
    ]
    last: dict[int, int] = {}
    followers = 0
    for o, c in zip(open_, closed):
        if c.follows is None:
            assert c.prompt == o.prompt  # a conversation's first turn is sent as planned
        else:
            followers += 1
            before = open_[c.follows]
            # the open plan's prompt with the stand-in answer replaced: its history, then the same message
            assert o.prompt.startswith(before.prompt + "\n") and o.prompt.endswith("\n" + c.prompt)
            assert c.follows < c.index and last.get(c.follows) is None  # each turn is followed at most once
            last[c.follows] = c.index
    assert followers > len(closed) / 2
    assert "the server's own previous answers" in KINDS["chat-kv-closed"].describe()


class _ChatTarget:
    """Answers every request with 'answer<index>' after `delay_s`, keeping what it was sent and when."""

    def __init__(self, delay_s=0.05):
        self.delay_s, self.sent = delay_s, {}

    async def send(self, p, rec, clock, text=None):
        rec.send_s = clock.now()
        self.sent[p.index] = (p.prompt, rec.send_s)
        await asyncio.sleep(self.delay_s)
        rec.first_token_s = rec.end_s = clock.now()
        rec.token_s, rec.status = [rec.end_s], "ok"
        if text is not None:
            text += ["answer", str(p.index)]


def test_a_following_turn_is_sent_after_the_answer_with_the_answer_in_its_prompt():
    from tools.replay.client import chat_turn

    planned = [
        Planned(0, 0.0, "hello", 1, 1),
        Planned(1, 0.0, "other", 1, 1),
        Planned(2, 0.01, "and then?", 99, 1, follows=0),  # due before turn 0 has answered
        Planned(3, 0.2, "more", 99, 1, follows=2),  # due after turn 2 answered
    ]
    target = _ChatTarget()
    res = asyncio.run(
        run_window(planned, target, None, None, 5.0, False, None, 0, count_tokens=lambda t: len(t.split()))
    )
    assert [r.status for r in res.records] == ["ok"] * 4
    second = chat_turn("hello", "answer0", "and then?")
    assert second == "helloanswer0\nand then?"  # the answer right after its prompt, as the server generated it
    assert target.sent[2][0] == second and target.sent[3][0] == chat_turn(second, "answer2", "more")
    r0, _, r2, r3 = res.records
    assert target.sent[2][1] >= r0.end_s and r2.arrival_s == r0.end_s  # due when the answer arrived
    assert r3.arrival_s == pytest.approx(0.2, abs=0.05) and r3.send_s >= 0.2  # due as planned
    assert r2.prompt_tokens == len(second.split())  # counted as sent, not the plan's estimate


def test_turns_that_follow_others_need_a_token_counter():
    planned = [Planned(0, 0.0, "a", 1, 1), Planned(1, 0.0, "b", 1, 1, follows=0)]
    with pytest.raises(ValueError, match="count_tokens"):
        asyncio.run(run_window(planned, _ChatTarget(), None, None, 1.0, False, None, 0))
