"""Multi-turn traffic for the capacity harness (tools/capacity/conversations.py) and the prefill it saves with
prefix caching (tools/capacity/prefix_reuse.py)."""

import pytest

from tools.capacity.conversations import BATCH, INTERACTIVE, Conversations, plan_turns
from tools.capacity.prefix_reuse import prefilled
from tools.replay.traces import TraceRequest

REQS = [TraceRequest(float(i), 20 + i % 7, 10 + i % 5) for i in range(400)]


def test_turns_keep_the_trace_and_grow_conversations_within_their_context():
    conv = Conversations(mean_turns=4, max_context_tokens=300)
    turns = conv.turns(REQS, seed=1)
    assert turns == conv.turns(REQS, seed=1)  # seeded
    assert [(t.arrival_s, t.message_tokens, t.output_tokens) for t in turns] == [
        (r.arrival_s, r.prompt_tokens, r.output_tokens) for r in REQS
    ]
    by_conv: dict[int, list] = {}
    for t in turns:
        by_conv.setdefault(t.conversation, []).append(t)
    assert 3 <= len(turns) / len(by_conv) <= 5  # about mean_turns
    for ts in by_conv.values():
        assert [t.turn for t in ts] == list(range(len(ts)))
        assert sum(t.message_tokens + t.output_tokens for t in ts) <= 300


def test_the_mixed_variant_gives_each_conversation_one_class():
    turns = Conversations(interactive_share=0.2).turns(REQS, seed=3)
    classes: dict[int, set] = {}
    for t in turns:
        classes.setdefault(t.conversation, set()).add(t.priority)
    assert all(len(c) == 1 for c in classes.values())
    interactive = sum(1 for c in classes.values() if c == {INTERACTIVE}) / len(classes)
    assert 0.1 < interactive < 0.3 and {p for c in classes.values() for p in c} == {INTERACTIVE, BATCH}


@pytest.mark.parametrize("bad", [dict(mean_turns=0.5), dict(max_context_tokens=1), dict(interactive_share=1.5)])
def test_bad_settings_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Conversations(**bad)


class _Prompts:
    """PromptSource's interface: text of about n 'tokens' (words), distinct per index."""

    class tok:
        @staticmethod
        def encode(text):
            return text.split()

    def prompt(self, index, n):
        return " ".join(f"w{index}_{i}" for i in range(n)), n


def test_a_turn_resends_its_conversation():
    turns = Conversations(mean_turns=3, max_context_tokens=10**6).turns(REQS[:50], seed=0)
    planned = plan_turns(turns, _Prompts())
    last: dict[int, str] = {}
    for t, p in zip(turns, planned):
        if t.conversation in last:
            assert p.prompt.startswith(last[t.conversation])
        assert p.priority == t.priority and p.output_tokens == t.output_tokens
        last[t.conversation] = p.prompt


def test_prefix_caching_prefills_only_what_no_earlier_turn_computed():
    history, prompts, answers = [], [], []
    for turn in range(4):
        prompts.append(history + list(range(1000 * turn, 1000 * turn + 40)))
        answers.append(list(range(1000 * turn + 500, 1000 * turn + 520)))
        history = prompts[-1] + answers[-1]
    off = prefilled(prompts, answers, pool_tokens=1024, block_size=16, caching=False)
    on = prefilled(prompts, answers, pool_tokens=1024, block_size=16, caching=True)
    assert off == sum(map(len, prompts))
    # each later turn reuses the full blocks of everything before its new message
    assert on == 40 + sum(len(p) - (len(p) - 40) // 16 * 16 for p in prompts[1:])
